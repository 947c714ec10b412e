"""``AutoEPMoELayer``: a Hugging Face MoE block with its experts sharded over the expert-parallel group.

The block's own router module is kept (replicated, data parallel): it computes the family's exact scores (top-k
softmax with or without renormalisation, DeepSeek's group-limited routing and scaling) and Transformers' output
recorder still captures its logits, so ``output_router_logits`` / the model's aux loss work unchanged. The
experts become :class:`AutoEPExperts` (``num_experts / ep_size`` per rank). Shared experts stay replicated and are
added as the family's block adds them: Qwen2/3.5-MoE scale the shared expert by ``sigmoid(shared_expert_gate)``,
DeepSeek adds it as is. Mixtral's training-time input jitter is applied as its block applies it.

Parameter names are the block's own (``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``,
``shared_expert...``), the expert ones holding this rank's ``L`` experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_moe import groups
from ds_moe.autoep._detect import MoELayerSpec
from ds_moe.autoep._experts import AutoEPExperts


class AutoEPMoELayer(nn.Module):
    """Drop-in replacement for a detected MoE block: ``forward(hidden_states [..., H]) -> [..., H]``."""

    _is_autoep_layer = True

    def __init__(self, spec: MoELayerSpec, source: nn.Module, ep_size: int = 1, ep_rank: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.num_experts, self.top_k = spec.num_experts, spec.top_k
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_local_experts = spec.num_experts // ep_size
        self.ep_group_name = f"ep_size_{ep_size}"
        self.jitter_noise = spec.jitter_noise
        self.add_module(spec.router_name, getattr(source, spec.router_name))
        fused = getattr(source, spec.experts_name)
        self.experts = AutoEPExperts.from_fused(fused, ep_size, ep_rank)
        # id of each replaced (full) expert parameter -> its local replacement, for remapping parameter lists
        # and optimizers built before the conversion; ids only, so the full weights can be freed
        self.replaced_param_ids = {id(fused.gate_up_proj): self.experts.gate_up_proj,
                                   id(fused.down_proj): self.experts.down_proj}
        for name in (spec.shared_experts_name, spec.shared_experts_gate_name):
            if name:
                self.add_module(name, getattr(source, name))
        for name in (spec.router_name, spec.shared_experts_name, spec.shared_experts_gate_name):
            for param in (getattr(self, name).parameters() if name else ()):
                param.allreduce = True  # replicated: plain data-parallel gradient averaging

    @property
    def router(self) -> nn.Module:
        return getattr(self, self.spec.router_name)

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self.experts.ep_group

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (once per ``ep_size``) the ``ep_size_<n>`` groups and bind this layer's expert-parallel group."""
        if not (dist.is_available() and dist.is_initialized()):
            if self.ep_size > 1:
                raise RuntimeError(f"AutoEP with autoep_size={self.ep_size} needs torch.distributed initialised")
            return
        if self.ep_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        group = groups._get_expert_parallel_group(self.ep_group_name)
        rank = dist.get_rank(group=group)
        if rank != self.ep_rank:
            raise RuntimeError(f"AutoEP layer {self.spec.name!r} holds the experts of expert-parallel rank "
                               f"{self.ep_rank}, but this process is rank {rank} of group {self.ep_group_name}")
        self.experts.ep_group = group

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        flat = hidden_states.reshape(-1, shape[-1])
        _, weights, indices = self.router(flat)
        out = self.experts(flat, indices, weights)
        if self.spec.shared_experts_name:
            shared = getattr(self, self.spec.shared_experts_name)(flat)
            if self.spec.shared_experts_gate_name:
                shared = torch.sigmoid(getattr(self, self.spec.shared_experts_gate_name)(flat)) * shared
            out = out + shared
        return out.reshape(shape)
