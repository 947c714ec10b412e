"""AutoEP folded onto AutoTP through ``deepspeed.initialize`` on 4 gloo ranks (tensor parallel 2, expert parallel
2): a tiny Mixtral trains with SGD to the same losses and weights as the plain data-parallel engine fed the same
batch on each tensor-parallel pair; and the checkpoint folding metadata."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed, shutdown_pool

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_workers_after():
    """A folded engine leaves tensor-parallel groups in deepspeed's module state of the pooled workers, which a
    later non-folded AutoEP test on the same workers would read as an mpu: give the next test new processes."""
    yield
    shutdown_pool()

STEPS = 3
SKIP_ALL = {"use_default_specs": False, "layer_specs": [{"patterns": [".*\\.weight$"], "partition_type": "skip"}]}
# attention split by heads over the tensor group; the MoE block is AutoEP's whatever the specs say about it
ATTENTION_SHARDED = {"use_default_specs": False, "layer_specs": [
    {"patterns": [".*self_attn\\.(q|k|v)_proj\\.weight$"], "partition_type": "column"},
    {"patterns": [".*self_attn\\.o_proj\\.weight$"], "partition_type": "row"},
    {"patterns": [".*mlp\\.gate\\.weight$"], "partition_type": "column"},
    {"patterns": [".*\\.weight$"], "partition_type": "skip"}]}


def _mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(config)


def _train(folded: bool, stage: int, specs: dict = SKIP_ALL) -> tuple[list[float], dict[str, torch.Tensor],
                                                                               int]:
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True}
    if folded:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral",
                                  "use_grouped_mm": False, "validate_folding_routing": True}
        cfg["tensor_parallel"] = {"autotp_size": 2, "partition_config": specs}
    engine, *_ = deepspeed.initialize(model=_mixtral(), config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank() // 2)  # a tensor-parallel pair shares its batch
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 32, (2, 9), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for layer in (m for m in engine.module.modules() if type(m).__name__ == "AutoEPMoELayer"):
        for name in ("w1", "w2", "w3"):  # every expert, gathered from the expert-parallel group in expert order
            local = getattr(layer.experts, name).detach()
            parts = [torch.empty_like(local) for _ in range(layer.ep_size)]
            dist.all_gather(parts, local.contiguous(), group=layer.ep_group)
            weights[f"experts.{name}"] = torch.cat(parts)
    folded_layers = sum(getattr(m, "folding_group_handles", None) is not None for m in engine.module.modules())
    return losses, weights, folded_layers


@pytest.mark.parametrize(("stage", "specs"), [(0, SKIP_ALL), (2, SKIP_ALL), (0, ATTENTION_SHARDED)],
                         ids=["zero0", "zero2", "zero0-attention-sharded"])
def test_folded_autoep_trains_like_plain_data_parallel(stage, specs):
    """``ATTENTION_SHARDED``: AutoTP shards the attention projections (and would the router, were it not AutoEP's)."""
    plain = run_distributed(_train, world_size=4, args=(False, stage), timeout=240)
    folded = run_distributed(_train, world_size=4, args=(True, stage, specs), timeout=240)
    # sharded attention sums its row-parallel halves in another order: rounding, amplified by 3 SGD steps
    tol = {"rtol": 1e-5, "atol": 1e-6} if specs is SKIP_ALL else {"rtol": 2e-4, "atol": 2e-5}
    for (want_losses, want_weights, none), (losses, weights, layers) in zip(plain, folded, strict=True):
        assert none == 0 and layers == 1
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **tol)
        router = weights["model.layers.0.mlp.router.gate.weight"]
        assert router.shape == want_weights["model.layers.0.mlp.gate.weight"].shape  # left whole by AutoTP
        torch.testing.assert_close(router, want_weights["model.layers.0.mlp.gate.weight"], **tol)
        for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"):
            torch.testing.assert_close(weights[name], want_weights[name], **tol)
        q_proj = "model.layers.0.self_attn.q_proj.weight"
        if specs is SKIP_ALL:  # sharded by AutoTP otherwise (its weights gathered only in checkpoints)
            torch.testing.assert_close(weights[q_proj], want_weights[q_proj], **tol)
        # experts: SGD sees their gradient's scale, so a missing tp_size correction would show here
        gate, up = want_weights["model.layers.0.mlp.experts.gate_up_proj"].chunk(2, dim=1)
        for name, want in (("w1", gate), ("w3", up), ("w2", want_weights["model.layers.0.mlp.experts.down_proj"])):
            torch.testing.assert_close(weights[f"experts.{name}"], want, **tol)


def test_folding_metadata_round_trip_and_mismatch():
    from deepspeed.checkpoint.autoep_universal import make_folding_metadata, validate_folding_metadata

    entry = make_folding_metadata(tp_size=2, tp_rank=1, ep_size=4, ep_rank=3, zero_partition_group="edp",
                                  zero_partition_rank=0, zero_partition_count=2, family="routed_expert")
    assert validate_folding_metadata({"folding": entry}, tp_size=2, ep_size=4, family="routed_expert")["tp_rank"] == 1
    with pytest.raises(RuntimeError, match="ep_size: saved=4, this run=2"):
        validate_folding_metadata({"folding": entry}, tp_size=2, ep_size=2)
    with pytest.raises(RuntimeError, match="Missing AutoEP\\+AutoTP folding metadata"):
        validate_folding_metadata({}, tp_size=2, ep_size=4)


def _checkpoint(folder: str) -> tuple[list[str], float, float, str]:
    import glob
    import os

    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral", "use_grouped_mm": False},
           "tensor_parallel": {"autotp_size": 2, "partition_config": SKIP_ALL}}
    g = torch.Generator().manual_seed(dist.get_rank() // 2)
    batches = [torch.randint(0, 32, (2, 9), generator=g) for _ in range(3)]
    engine, *_ = deepspeed.initialize(model=_mixtral(), config=cfg)
    for ids in batches[:2]:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(folder, tag="t")
    want = float(engine(input_ids=batches[2], labels=batches[2]).loss)
    families = sorted({torch.load(path, weights_only=False)["folding"]["family"]
                       for path in glob.glob(os.path.join(folder, "t", "*.pt"))})
    resumed, *_ = deepspeed.initialize(model=_mixtral(), config=cfg)
    resumed.load_checkpoint(folder, tag="t")
    got = float(resumed(input_ids=batches[2], labels=batches[2]).loss)
    dist.barrier()
    if dist.get_rank() == 0:  # a folded run refuses a model-states file without the layout
        for path in glob.glob(os.path.join(folder, "t", "mp_rank_*_model_states.pt")):
            state = torch.load(path, weights_only=False)
            del state["folding"]
            torch.save(state, path)
    dist.barrier()
    again, *_ = deepspeed.initialize(model=_mixtral(), config=cfg)
    try:
        again.load_checkpoint(folder, tag="t")
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    return families, want, got, error


def test_folded_checkpoint_records_the_layout_and_resumes(tmp_path):
    for families, want, got, error in run_distributed(_checkpoint, world_size=4, args=(str(tmp_path),), timeout=240):
        assert families == ["dense", "routed_expert", "zero_optimizer_state"]
        assert got == want
        assert "Missing AutoEP+AutoTP folding metadata" in error


def _folded_resume(folder: str, tp: int, ep: int) -> tuple[list[str], float, float, str]:
    """Save at tensor parallel ``tp`` x expert parallel ``ep``, load into a fresh engine, the next loss; then a
    missing per-expert file's error."""
    import os

    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral", "use_grouped_mm": False},
           "tensor_parallel": {"autotp_size": tp, "partition_config": SKIP_ALL}}
    g = torch.Generator().manual_seed(dist.get_rank() // tp)  # a tensor-parallel group shares its batch
    batches = [torch.randint(0, 32, (2, 9), generator=g) for _ in range(3)]
    engine, *_ = deepspeed.initialize(model=_mixtral(), config=cfg)
    for ids in batches[:2]:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(folder, tag="t")
    want = float(engine(input_ids=batches[2], labels=batches[2]).loss)
    expert_files = sorted(n for n in os.listdir(os.path.join(folder, "t")) if n.startswith("layer_"))
    resumed, *_ = deepspeed.initialize(model=_mixtral(), config=cfg)
    resumed.load_checkpoint(folder, tag="t")
    got = float(resumed(input_ids=batches[2], labels=batches[2]).loss)
    dist.barrier()
    if dist.get_rank() == 0:
        lost = ((tp - 1) % ep) * 2  # the first expert of the last tensor-parallel rank
        os.remove(os.path.join(folder, "t", f"layer_0_expert_{lost}_mp_rank_{tp - 1:02d}_model_states.pt"))
    dist.barrier()
    again, *_ = deepspeed.initialize(model=_mixtral(), config=cfg)
    try:
        again.load_checkpoint(folder, tag="t")
        error = ""
    except RuntimeError as exc:  # the rank that misses it names the file; the others are told which rank failed
        error = str(exc)
    return expert_files, want, got, error


@pytest.mark.parametrize(("tp", "ep"), [(4, 2), (2, 2)], ids=["tp4-ep2", "tp2-ep2"])
def test_folded_checkpoint_loads_at_every_tp_ep(tmp_path, tp, ep):
    """tp 4 > ep 2: the expert-data-parallel peers (0, 2) and (1, 3) sit at different tensor-parallel ranks, so
    each (tensor-parallel rank, expert) pair needs its own file (named ``mp_rank_<tp rank>``, as in DeepSpeed)."""
    results = run_distributed(_folded_resume, world_size=4, args=(str(tmp_path), tp, ep), timeout=300)
    for rank, (files, want, got, error) in enumerate(results):
        # every tensor-parallel rank has every expert it can hold: expert e lives on ep rank e // 2
        held = {(r % tp, (r % ep) * 2 + local) for r in range(4) for local in range(2)}
        assert files == sorted(f"layer_0_expert_{e}_mp_rank_{t:02d}_model_states.pt" for t, e in held)
        assert got == want  # bitwise: the resumed engine's next loss is the saved engine's
        lost = ((tp - 1) % ep) * 2  # every rank is told the reader's error (nothing loads anywhere)
        assert f"layer_0_expert_{lost}_mp_rank_{tp - 1:02d}_model_states.pt: missing" in error, (rank, error)
        assert f"expected layout: AutoEP folded onto AutoTP (tp_size={tp}, ep_size={ep})" in error
