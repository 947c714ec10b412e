"""Builders under DeepSpeed's names for the rest of its op catalogue.

``deepspeed.ops.op_builder`` exports one builder per op, and scripts (DeepSpeed's own tests among them) import
them to ask ``deepspeed.ops.__compatible_ops__[Builder.NAME]`` before using the op. Two kinds live here:

- ops this version implements in torch (the transformer kernel layer): a
  :class:`~ds_ops.op_builder.torch_ops.TorchOpBuilder`, compatible wherever torch runs, ``load()`` returning the
  module that implements the op;
- ops of features this version does not have (inference kernels, FastGen's ragged ops, FP8/FP6 and int8
  quantizer kernels, GPUDirect Storage, the Triton block-sparse kernels ``sparse_attn`` names: this version's
  block-sparse attention runs on torch without them, ...): a :class:`NotBuiltOpBuilder`, never compatible,
  never installed, whose ``load()`` raises :class:`OpBuildError` naming the feature (as DeepSpeed's builders
  do for ops a machine cannot run), so callers skip them instead of failing at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, NoReturn

from ds_ops.op_builder._builder import OpBuildError
from ds_ops.op_builder.torch_ops import TorchOpBuilder


class TransformerBuilder(TorchOpBuilder):
    """The transformer kernel layer, in torch (``ds_ops.transformer.DeepSpeedTransformerLayer``)."""

    NAME = "transformer"
    BUILD_VAR = "DS_BUILD_TRANSFORMER"
    MODULE = "ds_ops.transformer"


class StochasticTransformerBuilder(TransformerBuilder):
    """The same layer with ``stochastic_mode=True`` (torch's fused attention dropout)."""

    NAME = "stochastic_transformer"
    BUILD_VAR = "DS_BUILD_STOCHASTIC_TRANSFORMER"


class NotBuiltOpBuilder:
    """An op of a feature this version does not provide: ``NAME``, ``BUILD_VAR``, ``FEATURE`` (what it is part
    of). It reports itself incompatible and not installed, and refuses to load, saying why."""

    NAME: ClassVar[str]
    BUILD_VAR: ClassVar[str]
    FEATURE: ClassVar[str]
    NOT_BUILT: ClassVar[bool] = True

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def sources(self) -> list[Path]:
        return []

    def compatibility_problems(self) -> list[str]:
        return [f"op {self.NAME!r} is part of {self.FEATURE}, which this version of the modular DeepSpeed does not "
                "provide"]

    def is_compatible(self, verbose: bool = False) -> bool:
        if verbose:
            print(f"[ds_ops] {self.NAME} is not compatible: " + " ".join(self.compatibility_problems()))
        return False

    def is_built(self) -> bool:
        return False

    def load(self, verbose: bool = True) -> NoReturn:
        raise OpBuildError(f"cannot load op {self.NAME!r}: " + " ".join(self.compatibility_problems()))

    def jit_load(self, verbose: bool = True) -> NoReturn:
        self.load(verbose)


def _not_built(cls_name: str, name: str, feature: str) -> type[NotBuiltOpBuilder]:
    return type(cls_name, (NotBuiltOpBuilder,), {
        "NAME": name, "BUILD_VAR": f"DS_BUILD_{name.upper()}", "FEATURE": feature, "__module__": __name__,
        "__doc__": f"DeepSpeed's ``{cls_name}`` (op {name!r}): part of {feature}, not built in this version."})


_INFERENCE = "the CUDA inference kernels (kernel injection, DeepSpeed-FastGen)"
InferenceBuilder = _not_built("InferenceBuilder", "transformer_inference", _INFERENCE)
InferenceCoreBuilder = _not_built("InferenceCoreBuilder", "inference_core_ops", _INFERENCE)
InferenceCutlassBuilder = _not_built("InferenceCutlassBuilder", "cutlass_ops", _INFERENCE)
RaggedOpsBuilder = _not_built("RaggedOpsBuilder", "ragged_device_ops", _INFERENCE)
RaggedUtilsBuilder = _not_built("RaggedUtilsBuilder", "ragged_ops", _INFERENCE)
SpatialInferenceBuilder = _not_built("SpatialInferenceBuilder", "spatial_inference", _INFERENCE)
QuantizerBuilder = _not_built("QuantizerBuilder", "quantizer", "the CUDA int4/int8 quantizer kernels")
FPQuantizerBuilder = _not_built("FPQuantizerBuilder", "fp_quantizer", "the FP8/FP6/FP12 quantizer kernels")
GDSBuilder = _not_built("GDSBuilder", "gds", "GPUDirect Storage (DeepNVMe's GDS handle)")
UtilsBuilder = _not_built("UtilsBuilder", "utils", "the native tensor utilities (flatten, byte casts)")
DeepCompileBuilder = _not_built("DeepCompileBuilder", "dc", "DeepCompile (compiler-driven ZeRO passes)")
SparseAttnBuilder = _not_built("SparseAttnBuilder", "sparse_attn", "the Triton block-sparse kernels "
                               "(sparse_attention.matmul.MatMul, sparse_attention.softmax.Softmax)")

TORCH_BUILDERS = (TransformerBuilder, StochasticTransformerBuilder)
NOT_BUILT_BUILDERS = (InferenceBuilder, InferenceCoreBuilder, InferenceCutlassBuilder, RaggedOpsBuilder,
                      RaggedUtilsBuilder, SpatialInferenceBuilder, QuantizerBuilder, FPQuantizerBuilder,
                      GDSBuilder, UtilsBuilder, DeepCompileBuilder,
                      SparseAttnBuilder)

__all__ = ["NOT_BUILT_BUILDERS", "NotBuiltOpBuilder", "TORCH_BUILDERS", *(c.__name__ for c in TORCH_BUILDERS),
           *(c.__name__ for c in NOT_BUILT_BUILDERS)]
