"""``deepspeed.io``: file writers ``torch.save`` can write checkpoints through: ``FastFileWriter`` (DeepNVMe: a
pinned buffer drained with async O_DIRECT writes), ``PyFileWriter`` (a plain file, the baseline) and
``MockFileWriter`` (counts bytes, writes nothing)."""

from deepspeed.io.fast_file_writer import FastFileWriter, FastFileWriterConfig
from deepspeed.io.mock_file_writer import MockFileWriter
from deepspeed.io.py_file_writer import PyFileWriter

__all__ = ["FastFileWriter", "FastFileWriterConfig", "MockFileWriter", "PyFileWriter"]
