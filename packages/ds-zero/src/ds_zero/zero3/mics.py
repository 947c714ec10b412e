"""MiCS (``mics_shard_size``): ZeRO-3 with the model states partitioned inside shard groups of ``S`` consecutive
data-parallel ranks and replicated across the ``W / S`` shard groups. Parameters are gathered inside the shard
group (optionally in two stages, ``mics_hierarchical_params_gather``); gradients are reduce-scattered inside it
and the reduced shards all-reduced across the replicas (``ds_zero.zeropp.options.configure_reducer``).

``MiCS_Init`` is ``zero.Init`` over the shard group: the model is built partitioned in the MiCS layout, with
every replica starting from data-parallel rank 0's initial values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ds_zero.zero3.init import Init, _read_config, mpu_partition_group


class MiCS_Init(Init):  # noqa: N801 (DeepSpeed's class name)
    """``zero.Init`` partitioning over MiCS shard groups. The config (``config_dict_or_path`` or ``config``) must set
    ``zero_optimization.mics_shard_size`` > 0 (a divisor of the data-parallel world size); the other arguments
    are ``zero.Init``'s."""

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 sequence_data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None) -> None:
        # imported here: ds_zero.zeropp.options builds on zero3's partition space (zero3 imports this module)
        from ds_zero.zeropp.options import ZeroPPOptions, partition_group, zeropp_space

        if not enabled:
            super().__init__(enabled=False)
            return
        cfg = _read_config(config_dict_or_path, config)
        zero = cfg.get("zero_optimization") or {}
        options = ZeroPPOptions.from_config(zero)
        if not options.mics:
            raise ValueError(f"MiCS_Init: zero_optimization.mics_shard_size={zero.get('mics_shard_size')!r}; "
                             "accepted: a positive divisor of the data-parallel world size")
        dp_group = sequence_data_parallel_group or data_parallel_group
        if dp_group is None and mpu is not None:  # with a sequence axis: the sequence-data group, as the engine
            dp_group = mpu_partition_group(mpu)
        if not dist.is_initialized():
            from ds_zero.zero3.init import _ensure_process_group

            _ensure_process_group()
        self.dp_group = dp_group
        super().__init__(data_parallel_group=partition_group(dp_group, options),
                         mem_efficient_linear=mem_efficient_linear, remote_device=remote_device,
                         pin_memory=pin_memory, config=cfg, dtype=dtype)
        self.space = zeropp_space(self.space, dp_group, options)
        self.mics_options = options
        if module is not None:
            self._partition_module(module)

    def _partition_params(self, params: Any) -> None:
        from ds_zero.zero3.param import is_partitioned

        todo = [p for p in dict.fromkeys(params) if not is_partitioned(p)]
        if todo and dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
            # every shard group starts from data-parallel rank 0's values (zero.Init broadcasts inside the group)
            src = dist.get_global_rank(self.dp_group, 0) if self.dp_group is not None else 0
            with torch.no_grad():
                for p in todo:
                    self.space.comm.broadcast(p.data, src=src, group=self.dp_group)
        super()._partition_params(todo)
