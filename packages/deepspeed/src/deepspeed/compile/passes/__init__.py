"""DeepCompile graph passes, each registered by name with ``deepspeed.compile.backend.register_compile_pass``:
``zero3_compile`` (ZeRO-3 gather/release and gradient reduce-scatter), ``zero_1_and_2_compile`` (ZeRO-1/2 gradient
reduction), the scheduling passes (``prefetch``, ``selective_gather``, ``offload_parameters``, ...),
``sp_compile`` (AutoSP) and ``long_context_checkpointing`` (AutoSP's selective activation checkpointing);
``contract`` validates a schedule against the passes' declared contracts."""
