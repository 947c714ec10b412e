"""Data sampling of the Data Efficiency Library: offline analysis, curriculum batch sampling, dynamic batching.

``data_analyzer.DataAnalyzer`` computes per-sample curriculum metrics and writes the index files;
``data_sampler.DeepSpeedDataSampler`` draws batches by the curriculum from them; ``indexed_dataset`` reads and
writes the ``MMapIndexedDataset`` files both use; ``variable_batch_size_and_lr`` packs samples into token-budget
micro batches and scales the LR by batch size (dynamic batching); ``utils`` holds the small shared helpers.
"""

from deepspeed.compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
