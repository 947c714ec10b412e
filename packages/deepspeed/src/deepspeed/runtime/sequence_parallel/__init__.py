"""``deepspeed.runtime.sequence_parallel``: DeepSpeed's module path for sequence-parallel process groups.

``parallel_state_sp`` is a module-level mpu with a sequence axis (pass the module itself as ``mpu=`` to
``deepspeed.initialize``). ``ulysses_sp`` is Arctic Long Sequence Training (Ulysses for Hugging Face models, the
sequence-sharding data loader adapter, tiled MLP and loss computation; docs/alst.md).
"""
