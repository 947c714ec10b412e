"""Every documented DeepSpeed module path that a component package serves, as one table.

Key: the module path existing DeepSpeed scripts import. Value: the module that provides its names.
Issues that add a component add its rows here; ``tests/deepspeed/test_compat_paths.py`` imports every row.
Paths the meta-package implements itself (``deepspeed.runtime.engine``, ...) are real modules, not rows.
"""

COMPAT_PATHS: dict[str, str] = {
    # configuration (ds-config)
    "deepspeed.runtime.zero.config": "ds_config.zero",
    "deepspeed.runtime.zero.offload_config": "ds_config.zero",
    "deepspeed.inference.config": "ds_config.inference",
    "deepspeed.runtime.config_utils": "ds_config.config_utils",  # DeepSpeedConfigModel & helpers
    "deepspeed.inference.engine": "ds_inference.engine",  # init_inference's engine (ds-inference, issue 16)
    "deepspeed.inference.quantization": "ds_inference.group_quant",  # group-wise INT4/INT8 weight quantization
    "deepspeed.monitor.config": "ds_config.monitor",
    # monitors (ds-monitor); deepspeed.monitor itself stays a namespace, as DeepSpeed's empty package
    "deepspeed.monitor.monitor": "ds_monitor.monitor",
    "deepspeed.monitor.tensorboard": "ds_monitor.tensorboard",
    "deepspeed.monitor.wandb": "ds_monitor.wandb",
    "deepspeed.monitor.comet": "ds_monitor.comet",
    "deepspeed.monitor.csv_monitor": "ds_monitor.csv_monitor",
    "deepspeed.monitor.utils": "ds_monitor.utils",
    # flops profiler (ds-profiler)
    "deepspeed.profiling.flops_profiler": "ds_profiler",
    "deepspeed.profiling.flops_profiler.profiler": "ds_profiler.profiler",
    "deepspeed.ops.aio": "ds_ops.aio",
    # native / fused optimizers and the op build system (ds-ops, issue 4)
    "deepspeed.ops.adam": "ds_ops.adam",
    "deepspeed.ops.adam.cpu_adam": "ds_ops.adam.cpu_adam",
    "deepspeed.ops.adam.fused_adam": "ds_ops.adam.fused_adam",
    # ZenFlow (issue 26): the selective AdamW (ds-ops), the config section (ds-config), the core split (ds-zero)
    "deepspeed.ops.adam.zenflow_torch_adam": "ds_ops.adam.zenflow_adam",
    "deepspeed.runtime.zenflow": "ds_zero.zenflow",
    "deepspeed.runtime.zenflow.zenflow_config": "ds_config.zero",
    "deepspeed.runtime.zenflow.zenflow_utils": "ds_zero.zenflow.cores",
    "deepspeed.runtime.zenflow.zenflow_stage_1_and_2": "ds_zero.zenflow.optimizer",  # ZenFlowZeroOptimizer
    "deepspeed.ops.adagrad": "ds_ops.adagrad",
    "deepspeed.ops.adagrad.cpu_adagrad": "ds_ops.adagrad.cpu_adagrad",
    "deepspeed.ops.lion": "ds_ops.lion",
    "deepspeed.ops.lion.cpu_lion": "ds_ops.lion.cpu_lion",
    "deepspeed.ops.lion.fused_lion": "ds_ops.lion.fused_lion",
    "deepspeed.ops.lamb": "ds_ops.lamb",
    "deepspeed.ops.lamb.fused_lamb": "ds_ops.lamb.fused_lamb",
    "deepspeed.ops.op_builder": "ds_ops.op_builder",
    # DeepSpeed4Science's Evoformer attention, in torch (ds-ops)
    "deepspeed.ops.deepspeed4science": "ds_ops.deepspeed4science",
    # block-sparse self-attention (ds-ops, issue 20)
    "deepspeed.ops.sparse_attention": "ds_ops.sparse_attention",
    # the transformer kernel layer (ds-ops, issue 16)
    "deepspeed.ops.transformer": "ds_ops.transformer",
    # ZeRO (ds-zero, issue 7)
    "deepspeed.runtime.zero.stage3": "ds_zero.stage3",
    # Muon (ds-ops: the update math and optimizers; ds_zero.muon runs it on full gradients under ZeRO)
    "deepspeed.runtime.zero.muon": "ds_ops.muon",
    "deepspeed.runtime.zero.muon.original_muon": "ds_ops.muon.original",
    "deepspeed.runtime.zero.muon.muon_optimizer": "ds_ops.muon.optimizer",
    # ZeRO-3 (ds-zero, issue 12)
    "deepspeed.zero": "ds_zero.zero3",
    "deepspeed.runtime.zero.partition_parameters": "ds_zero.partition_parameters",
    "deepspeed.runtime.zero.parameter_offload": "ds_zero.zero3.parameter_offload",
    "deepspeed.runtime.zero.offload_states": "ds_zero.offload_states",
    "deepspeed.runtime.zero.utils": "ds_zero.utils",
    "deepspeed.runtime.zero.tiling": "ds_zero.zero3.tiled_linear",
    "deepspeed.utils.zero_to_fp32": "ds_zero.zero_to_fp32",
    # pipeline process topology (ds-pipe, issue 14)
    "deepspeed.runtime.pipe.topology": "ds_pipe.topology",
    # pipeline schedules (ds-pipe, issue 14)
    "deepspeed.runtime.pipe.schedule": "ds_pipe.schedule",
    # pipeline model: PipelineModule, LayerSpec, TiedLayerSpec (ds-pipe, issue 14)
    "deepspeed.runtime.pipe.module": "ds_pipe.module",
    "deepspeed.pipe": "ds_pipe.pipe_api",
    # Mixture of Experts (ds-moe, issue 15)
    "deepspeed.moe": "ds_moe",
    "deepspeed.moe.layer": "ds_moe.layer",
    "deepspeed.moe.sharded_moe": "ds_moe.sharded_moe",
    "deepspeed.moe.experts": "ds_moe.experts",
    "deepspeed.moe.utils": "ds_moe.utils",
    # AutoEP (ds_moe.autoep and its grouped-expert pieces)
    "deepspeed.module_inject.auto_ep": "ds_moe.autoep.detect",
    "deepspeed.module_inject.auto_ep_config": "ds_moe.autoep.config",
    "deepspeed.module_inject.auto_ep_layer": "ds_moe.autoep.layer",
    "deepspeed.module_inject.auto_ep_folding": "ds_moe.autoep.folding",
    "deepspeed.module_inject.auto_ep_preset_adapters": "ds_moe.autoep.presets",
    "deepspeed.module_inject.auto_ep_presets.base": "ds_moe.autoep.adapters",
    "deepspeed.module_inject.auto_ep_presets.registry": "ds_moe.autoep.presets",
    "deepspeed.moe.ep_count": "ds_moe.ep_count",
    "deepspeed.moe.ep_experts": "ds_moe.ep_experts",
    "deepspeed.moe.ep_kernels": "ds_moe.ep_kernels",
    "deepspeed.moe.ep_repack": "ds_moe.ep_repack",
    "deepspeed.moe.ep_router": "ds_moe.ep_router",
    "deepspeed.moe.ep_tp_dispatch": "ds_moe.ep_tp_dispatch",
    "deepspeed.moe.fused_expert_layout": "ds_moe.fused_expert_layout",
    # AutoTP (ds-inference, issue 16); deepspeed.module_inject (and .layers) are real modules re-exporting these
    "deepspeed.module_inject.auto_tp": "ds_inference.autotp",
    "deepspeed.module_inject.autotp_config": "ds_inference.autotp",
    "deepspeed.module_inject.replace_module": "ds_inference.autotp",
    "deepspeed.module_inject.tp_plan_converter": "ds_inference.autotp.tp_plan_converter",
    # elastic training batch arithmetic (ds-config, issue 17)
    "deepspeed.elasticity.elasticity": "ds_config.elastic",
    "deepspeed.elasticity.config": "ds_config.elasticity",
    "deepspeed.elasticity.constants": "ds_config.elastic_constants",
}


_KERNEL_INJECTION = "inference kernel injection (deepspeed.module_inject.containers)"

NOT_BUILT: dict[str, str] = {
    # documented module path (and everything below it) -> the feature it belongs to, not built in this version
    "deepspeed.inference.v2": "DeepSpeed-FastGen ragged-batching inference (deepspeed.inference.v2)",
    "deepspeed.module_inject.containers": "inference kernel injection (deepspeed.module_inject.containers)",
    # the inference kernels' config and elementwise ops are served (ds_ops.transformer.inference); its layers not
    "deepspeed.ops.transformer.inference.ds_attention": _KERNEL_INJECTION,
    "deepspeed.ops.transformer.inference.ds_mlp": _KERNEL_INJECTION,
    "deepspeed.ops.transformer.inference.moe_inference": _KERNEL_INJECTION,
    "deepspeed.ops.transformer.inference.diffusers_attention": _KERNEL_INJECTION,
    "deepspeed.ops.transformer.inference.diffusers_transformer_block": _KERNEL_INJECTION,
    "deepspeed.ops.transformer.inference.diffusers_2d_transformer": _KERNEL_INJECTION,
    "deepspeed.ops.transformer.inference.triton": _KERNEL_INJECTION,
    "deepspeed.ops.transformer.inference.triton_ops": _KERNEL_INJECTION,
    "deepspeed.ops.transformer.inference.bias_add": _KERNEL_INJECTION,
    "deepspeed.model_implementations": "inference kernel injection (deepspeed.module_inject.containers)",
    "deepspeed.runtime.hybrid_engine_graph": "CUDA-graph capture of the hybrid engine's token generation "
                                             "(deepspeed.runtime.hybrid_engine_graph)",
    # paths DeepSpeed 0.19.6's own unit tests import (docs/upstream-tests.md)
    "deepspeed.ops.triton_ops": "the Triton kernels (deepspeed.ops.triton_ops)",
    "deepspeed.ops.sparse_attention.matmul": "the Triton block-sparse kernels (sparse_attention.matmul.MatMul, "
                                             "sparse_attention.softmax.Softmax)",
    "deepspeed.ops.sparse_attention.softmax": "the Triton block-sparse kernels (sparse_attention.matmul.MatMul, "
                                              "sparse_attention.softmax.Softmax)",
    "deepspeed.compile.inductor": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.fx": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.profilers": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.util": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.partitioner": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.passes.selective_gather": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.backend": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.z3_eager_fallback": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.list_schedule": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.init_z3": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.init_z1_and_2": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.graph_param": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.passes.contract": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.passes.zero3_compile": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.passes.zero_1_and_2_compile": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.passes.prefetch": "DeepCompile (compiler-driven ZeRO passes)",
    "deepspeed.compile.passes.offload_parameters": "DeepCompile (compiler-driven ZeRO passes)",
}
"""Documented paths of features this version does not have yet: importing one raises ``FeatureNotAvailable`` (a
``ModuleNotFoundError``) naming the feature, instead of a bare "No module named ...". Rows leave as features land."""

NOT_BUILT_NAMES: dict[str, str] = {
}
"""Documented top-level ``deepspeed.<name>`` attributes of features not built yet (an ``AttributeError`` naming
them)."""
