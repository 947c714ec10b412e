"""DeepCompile's operators: ``dc_ops`` (the ``torch.ops.dc`` operators the ZeRO passes put into graphs), ``handle``
(the runtime those operators act on), ``tp_collectives`` (AutoTP's)."""
