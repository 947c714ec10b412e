"""DeepCompile (``deepspeed.compile``): compiler passes run by ``DeepSpeedEngine.compile`` when the config's
``compile.deepcompile`` is on. Built: the backend and pass schedule (``backend``), the ``torch.ops.dc`` operators
and their runtime (``custom_ops``), the inductor wiring, the scheduling passes and profilers (``list_schedule``,
``passes.prefetch`` / ``selective_gather`` / ``offload_parameters``, ``profilers``, ``partitioner``), and AutoSP
(``passes: ["autosp"]``, ``passes.sp_compile``); the engine does not yet accept the ZeRO passes (see
docs/deepcompile.md). Nothing here is imported by ``import deepspeed``."""
