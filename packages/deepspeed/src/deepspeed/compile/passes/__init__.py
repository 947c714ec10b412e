"""DeepCompile graph passes: ``sp_compile`` (AutoSP)."""
