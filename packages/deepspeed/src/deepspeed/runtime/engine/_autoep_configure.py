"""``DeepSpeedEngine._configure_expert_parallel(model)``: the engine configures AutoEP (``expert_parallel``), as in
DeepSpeed, from its own config and model-parallel unit: the sizes (world, pipeline from the mpu, AutoTP's tensor
size, the sequence size from the mpu else ``deepspeed.utils.groups``) and the features the folded layout refuses.
The step itself is ``deepspeed.runtime.autoep``; the constructor runs it before the module is cast and placed, then
points a client parameter list or optimizer at the new expert tensors (:meth:`_configure_autoep`).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.runtime import autoep
from deepspeed.runtime.engine._zero3 import _setting
from deepspeed.utils import groups
from ds_moe.autoep import as_autoep_config


class AutoEPConfigureMethods:
    """Mixed into ``DeepSpeedEngine``; requires ``self._config``, ``self.mpu`` and the config accessors."""

    mpu: Any
    _config: Any
    _autoep_folding_spec: Any

    autotp_size: Any
    zero_optimization_stage: Any
    zero_offload_optimizer: Any
    zero_offload_param: Any

    def _configure_autoep(self, model: torch.nn.Module, optimizer: Any, model_parameters: Any) -> tuple[Any, Any]:
        """AutoEP for the constructor: configure it, then return ``(optimizer, model_parameters)`` pointed at the
        AutoEP layers' expert tensors."""
        section = _setting(self._config, "expert_parallel_config", "expert_parallel")
        if section is None or not section.enabled:
            return optimizer, model_parameters
        self._configure_expert_parallel(model)
        model_parameters, optimizer = autoep.remap_client_parameters(model, model_parameters, optimizer)
        return optimizer, model_parameters

    def _configure_expert_parallel(self, model: torch.nn.Module) -> None:
        """Check the ``expert_parallel`` section against this run, create the expert groups, replace ``model``'s
        MoE blocks by AutoEP layers; records the folded layout (``_autoep_folding_spec``) when AutoEP is folded
        onto AutoTP. Collective."""
        section = _setting(self._config, "expert_parallel_config", "expert_parallel")
        if section is None or not section.enabled:
            return
        config = as_autoep_config(section)
        tp_size = max(int(self.autotp_size() or 1), 1)
        world = autoep.world_size()
        sp_size = int(self._autoep_sequence_parallel_world_size()) if world is not None else 1
        autoep.refuse_client_tensor_parallel(self.mpu, tp_size)  # first, as DeepSpeed: before any other setting
        cfg = self._config
        run = autoep.AutoEPRun(
            config=config, tp_size=tp_size, sp_size=sp_size, mpu=self.mpu, zero_stage=self.zero_optimization_stage(),
            zero_offload_optimizer=autoep.offloads(self.zero_offload_optimizer()),
            zero_offload_param=autoep.offloads(self.zero_offload_param()),
            deepcompile=bool(_setting(cfg, "compile_config.deepcompile", "compile.deepcompile", default=False)),
            use_data_before_expert_parallel=bool(_setting(cfg, "use_data_before_expert_parallel_",
                                                          "use_data_before_expert_parallelism", default=False)),
            tp_preset_model=_setting(cfg, "tensor_parallel_config.preset_model", "tensor_parallel.preset_model"))
        spec = autoep.configure_expert_parallel(model, run)
        if spec is not None:
            self._autoep_folding_spec = spec

    def _autoep_sequence_parallel_world_size(self) -> int:
        """The sequence-parallel world size AutoEP's layout is checked against: the mpu's when it has one, else
        ``deepspeed.utils.groups``'."""
        mpu = getattr(self, "mpu", None)
        if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
            return int(mpu.get_sequence_parallel_world_size())
        return int(groups._get_sequence_parallel_world_size())
