"""MiCS and ZeRO++ for ZeRO-3: sub-groups (``groups``), blockwise int8 quantizers (``quant``), quantized /
hierarchical / secondary-partition gathers (``gather``), the qgZ quantized all-to-all reduce with LoCo error
feedback (``qgz``), the resolved options (``options``) and byte counts of the collectives (``traffic``).

Only the quantizers and the byte counts are imported here: ``options`` and ``gather`` build on ``ds_zero.zero3``,
which imports them in turn."""

from ds_zero.zeropp.quant import Quantized, dequantize, pack, quantize, unpack, wire_bytes
from ds_zero.zeropp.traffic import reset, sent_bytes

__all__ = [
    "Quantized",
    "dequantize",
    "pack",
    "quantize",
    "reset",
    "sent_bytes",
    "unpack",
    "wire_bytes",
]
