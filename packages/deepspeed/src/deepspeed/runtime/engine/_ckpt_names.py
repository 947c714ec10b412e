"""DeepSpeed's engine methods that name a checkpoint's files (``engine._get_ckpt_name(path, tag)``, ...): clients
and DeepSpeed's own tests call or patch them. The file layout itself is ``runtime.checkpointing.layout``'s."""

from __future__ import annotations

import glob
import os
import stat
from typing import Any

import torch.distributed as dist

from deepspeed.runtime.checkpointing.layout import model_states_name
from deepspeed.runtime.engine._autoep_checkpoint import load_moe_state_dict
from deepspeed.utils.logging import logger


class CheckpointNameMethods:
    """Mixin for ``DeepSpeedEngine``; requires ``checkpoint_mp_rank``, ``dp_group`` and
    ``zero_optimization_stage()``."""

    checkpoint_mp_rank: int  # the mp_rank_XX of this rank's files (0 without model parallelism)
    dp_group: Any

    def _get_ckpt_name(self, checkpoints_path: str, tag: Any, mp_placeholder: str | None = None,
                       pp_placeholder: str | None = None) -> str:
        """This rank's model-states file: ``mp_rank_XX_model_states.pt``, under ZeRO-3 one per data-parallel rank
        (``zero_pp_rank_<dp>_mp_rank_XX_model_states.pt``). The placeholders replace the ranks (glob patterns)."""
        mp = mp_placeholder if mp_placeholder is not None else f"{self.checkpoint_mp_rank:02d}"
        if self.zero_optimization_stage() == 3:  # type: ignore[attr-defined]
            # ZeRO-3 partitions over the sequence-data group (the data-parallel group without sequence parallelism)
            group = getattr(self, "seq_dp_group", self.dp_group)
            dp = pp_placeholder if pp_placeholder is not None else (
                dist.get_rank(group) if dist.is_initialized() else 0)
            name = f"zero_pp_rank_{dp}_mp_rank_{mp}_model_states.pt"
        else:
            name = f"mp_rank_{mp}_model_states.pt" if mp_placeholder is not None \
                else model_states_name(self.checkpoint_mp_rank)
        return os.path.join(checkpoints_path, str(tag), name)

    def _get_all_ckpt_names(self, checkpoints_path: str, tag: Any) -> list[str]:
        """Every model-parallel rank's model-states file of ``tag`` present on disk, sorted."""
        return sorted(glob.glob(self._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*")))

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: Any, expp_rank: int) -> str:
        """The optimizer file of expert-parallel rank ``expp_rank`` (MoE without ZeRO)."""
        name = f"expp_rank_{expp_rank}_mp_rank_{self.checkpoint_mp_rank:02d}_optim_states.pt"
        return os.path.join(checkpoints_path, str(tag), name)

    def _get_zero_param_shapes(self) -> list[dict[str, Any]]:
        """``[{name: shape}]`` per ZeRO parameter group (ZeRO-3: per sub-group) in the order of the flat
        partitions, as the ZeRO extension records it in the model-states file (``param_shapes``)."""
        for shard in getattr(self, "checkpoint_shards", ()):
            extras = getattr(shard, "model_state_extras", None)
            shapes = extras().get("param_shapes") if extras is not None else None
            if shapes is not None:
                return shapes
        raise RuntimeError("engine._get_zero_param_shapes: no ZeRO optimizer (zero_optimization.stage 1-3) records "
                           f"flat partitions here (stage {self.zero_optimization_stage()})")  # type: ignore[attr-defined]

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """Make the ``zero_to_fp32.py`` copied beside a ZeRO checkpoint executable; where the file system refuses
        (file shares) or the file is gone, say so and go on."""
        try:
            os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
        except (FileNotFoundError, PermissionError) as e:
            logger.info(f"Warning: Could not change permissions for {dst} due to error: {e}. Continuing without "
                        "changing permissions.")

    # DeepSpeed's static method: this rank's experts from the per-expert files (native MoE and AutoEP layers)
    load_moe_state_dict = staticmethod(load_moe_state_dict)

    @staticmethod
    def _get_expert_ckpt_name(checkpoints_path: str, layer_id: int, expert_id: int, tag: Any, mpu: Any = None,
                              checkpoint_mp_rank: int | None = None) -> str:
        """One expert's weights: ``layer_<l>_expert_<e>_mp_rank_XX_model_states.pt``."""
        if checkpoint_mp_rank is None:
            checkpoint_mp_rank = 0 if mpu is None else mpu.get_model_parallel_rank()
        return os.path.join(checkpoints_path, str(tag),
                            f"layer_{layer_id}_expert_{expert_id}_mp_rank_{checkpoint_mp_rank:02d}_model_states.pt")
