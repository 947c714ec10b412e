"""Shared by the MiCS / ZeRO++ tests: a tiny GPT-2-like model, a training loop through ``deepspeed.initialize``
that returns the global losses, the whole weights and the bytes the ZeRO-3 collectives sent."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

VOCAB, DIM, SEQ, MICRO = 32, 16, 8, 2


class TinyGPT(torch.nn.Module):
    """Token + position embeddings, one pre-LayerNorm block (causal attention, GELU MLP), tied LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, DIM)
        self.wpe = torch.nn.Embedding(SEQ, DIM)
        self.ln1 = torch.nn.LayerNorm(DIM)
        self.attn = torch.nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias gets only rounding noise (softmax)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.ln2 = torch.nn.LayerNorm(DIM)
        self.fc = torch.nn.Linear(DIM, 4 * DIM)
        self.out = torch.nn.Linear(4 * DIM, DIM)
        self.lnf = torch.nn.LayerNorm(DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids[:, :-1]) + self.wpe.weight[: ids.shape[1] - 1]
        q, k, v = self.attn(self.ln1(x)).view(x.shape[0], x.shape[1], 3, 2, DIM // 2).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(x.shape))
        x = x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))
        logits = self.lnf(x) @ self.wte.weight.t()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def config(zero: dict, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}, **extra}


def batches(steps: int, batch: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (batch, SEQ), generator=gen) for _ in range(steps)]


def whole_state(engine) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}


def train(cfg: dict, steps: int, node_size: int | None = None, save: str | None = None,
          load: str | None = None, model: torch.nn.Module | None = None, freeze: tuple[str, ...] = (),
          mpu: object = None) -> dict:
    """Train ``steps`` steps (rank r takes its slice of each global batch); returns the global mean losses, the
    whole weights and the bytes sent by the ZeRO-3 collectives (by kind). ``node_size`` plays the launcher's
    LOCAL_WORLD_SIZE (ranks per node); ``save``/``load``: a checkpoint folder written after / read before;
    ``model``: a model built by the caller (under ``zero.Init``); ``freeze``: names of parameters that do not
    train (their partitions' dtypes come back in ``frozen_dtypes``); ``mpu``: passed to ``deepspeed.initialize``."""
    launcher = os.environ.get("LOCAL_WORLD_SIZE")
    if node_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(node_size)
    try:
        return _train(cfg, steps, save, load, model, freeze, mpu)
    finally:
        if launcher is not None:
            os.environ["LOCAL_WORLD_SIZE"] = launcher


def _train(cfg: dict, steps: int, save: str | None, load: str | None, model: torch.nn.Module | None,
           freeze: tuple[str, ...], mpu: object) -> dict:
    import deepspeed
    from ds_zero.zeropp import traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # a different init per rank: the engine starts every rank from rank 0's
    model = model if model is not None else TinyGPT()
    for name, p in model.named_parameters():
        p.requires_grad_(name not in freeze)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, mpu=mpu)
    if load is not None:
        engine.load_checkpoint(load)
    traffic.reset()
    losses = []
    for ids in batches(steps, MICRO * world):
        loss = engine(ids[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    out = {"losses": losses, "bytes": traffic.sent_bytes(), "state": whole_state(engine),
           "frozen_dtypes": [p.ds_tensor.dtype for n, p in engine.module.named_parameters() if n in freeze],
           "space": _space(next(engine.module.parameters()).ds_space),
           "accessors": (engine.zero_hpz_partition_size(), engine.zero_quantized_weights(),
                         engine.zero_quantized_gradients(), engine.zero_quantized_nontrainable_weights())}
    if save is not None:
        engine.save_checkpoint(save, tag="t")
    return out


def _space(space) -> dict:
    """The partition space's ZeRO++ parts: group sizes of the partition, hpZ and the MiCS hierarchy."""
    hierarchy = getattr(space, "hierarchy", None)
    secondary = getattr(space, "secondary", None)
    return {"world": space.world, "secondary": secondary.world if secondary is not None else None,
            "hierarchy": tuple(g.world for g in hierarchy) if hierarchy is not None else None}


def rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    return num / sum(float(b[k].norm() ** 2) for k in b) ** 0.5
