"""DeepCompile (``deepspeed.compile``): compiler passes run by ``DeepSpeedEngine.compile`` when the config's
``compile.deepcompile`` is on. This version provides AutoSP (``passes: ["autosp"]``), automatic Ulysses sequence
parallelism for SDPA models (``deepspeed.compile.passes.sp_compile``), with its selective activation checkpointing
(``passes.long_context_checkpointing``); DeepCompile's ZeRO and AutoTP passes are not built. Nothing here is
imported by ``import deepspeed``."""
