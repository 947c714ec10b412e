"""DeepCompile graph passes: ``sp_compile`` (AutoSP) and ``long_context_checkpointing`` (AutoSP's selective
activation checkpointing)."""
