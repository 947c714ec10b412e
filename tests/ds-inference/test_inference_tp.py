"""Tensor-parallel inference over 2 gloo ranks and checkpoint re-sharding (2 -> 1 -> 2, Megatron-style lists)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from _inference_models import BUILDERS, GENERATIVE, tiny_gpt2, tiny_llama, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_inference import init_inference
from ds_inference.autotp import TensorParallel_Layer
from ds_inference.checkpoint import CONFIG_NAME, describe_checkpoint

FP32 = {"rtol": 1e-5, "atol": 1e-5}


class _PolicyClass:
    """Stands for a kernel-injection policy class such as ``HFBertLayerPolicy``."""


@torch.no_grad()
def _tp2_matches_plain(names: list[str]) -> list[str]:
    ids, mask = token_ids(), None
    checked = []
    for name in names:
        model = BUILDERS[name]()
        engine = init_inference(copy.deepcopy(model), tensor_parallel={"tp_size": 2}, dtype=torch.float)
        local = [p.numel() for p in engine.module.parameters()]
        assert sum(local) < sum(p.numel() for p in model.parameters())  # really sharded
        torch.testing.assert_close(engine(input_ids=ids).logits, model(input_ids=ids).logits, **FP32)
        if name in GENERATIVE:
            mask = torch.ones_like(ids)
            ours = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
            ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
            assert torch.equal(ours, ref), name
        checked.append(name)
    # the all-reduce layers named by hand (DeepSpeed's injection_policy) instead of AutoTP's heuristics
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = tiny_llama()
    policy = {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}
    engine = init_inference(copy.deepcopy(model), dtype=torch.float, tp={"tp_size": 2}, injection_policy=policy)
    torch.testing.assert_close(engine(input_ids=ids).logits, model(input_ids=ids).logits, **FP32)
    # DeepSpeed's documented form maps the block to a kernel-injection policy class: sharded by the heuristics
    engine = init_inference(copy.deepcopy(model), dtype=torch.float, tp={"tp_size": 2},
                            injection_policy={LlamaDecoderLayer: _PolicyClass})
    torch.testing.assert_close(engine(input_ids=ids).logits, model(input_ids=ids).logits, **FP32)
    with pytest.raises(TypeError, match="value for .*LlamaDecoderLayer.* must name its all-reduce linears"):
        init_inference(copy.deepcopy(model), dtype=torch.float, tp={"tp_size": 2},
                       injection_policy={LlamaDecoderLayer: 3})
    with pytest.raises(ValueError, match="'mlp.out' .*matches no module"):
        init_inference(copy.deepcopy(model), dtype=torch.float, tp={"tp_size": 2},
                       injection_dict={LlamaDecoderLayer: ("self_attn.o_proj", "mlp.out")})
    # an explicit tp_group and int8 weights on top of the shards
    model = tiny_llama()
    engine = init_inference(copy.deepcopy(model), dtype=torch.int8, tensor_parallel={"tp_group": dist.group.WORLD},
                            quant={"weight": {"q_groups": 2}})
    ref = model(input_ids=ids).logits
    # the sharded layers' weights (and the embeddings) are int8, not left float; the repr still works
    sharded = [n for n, m in engine.module.named_modules() if isinstance(m, TensorParallel_Layer)]
    assert sharded and set(sharded) <= set(engine.quantized_modules) and "model.embed_tokens" in str(engine.module)
    assert 0 < (engine(input_ids=ids).logits - ref).abs().max() <= 0.03 * ref.abs().max()
    return checked


def test_two_ranks_give_the_plain_models_logits_and_tokens():
    results = run_distributed(_tp2_matches_plain, world_size=2, args=(sorted(BUILDERS),), timeout=120)
    assert results == [sorted(BUILDERS)] * 2


def _save_at_two(path: str, seed: int, load: str | None) -> dict:
    model = tiny_gpt2(seed=seed)
    kwargs = {"checkpoint": load} if load else {}
    engine = init_inference(model, dtype=torch.float, tensor_parallel={"tp_size": 2}, save_mp_checkpoint_path=path,
                            **kwargs)
    with torch.no_grad():
        logits = engine(input_ids=token_ids()).logits
    return {"logits": logits, "state": {k: v.clone() for k, v in engine.module.state_dict().items()}}


def test_checkpoint_reshard_round_trip_two_one_two(tmp_path):
    two, one, two_again = (str(tmp_path / d) for d in ("tp2", "tp1", "tp2b"))
    first = run_distributed(_save_at_two, world_size=2, args=(two, 0, None), timeout=120)
    with open(os.path.join(two, CONFIG_NAME)) as handle:
        meta = json.load(handle)
    assert meta["tp_size"] == 2 and meta["parallelization"] == "tp" and meta["type"] == "ds_model"
    assert meta["checkpoints"]["tp"] == ["tp_00_00.pt", "tp_01_00.pt"]
    # GPT-2's fused QKV: each rank holds a slice of Q, of K and of V; the JSON records where each came from
    assert [len(r) for r in meta["tp_layouts"]["transformer.h.0.attn.c_attn.weight"]["pieces"]] == [3, 3]
    # 2 -> 1: a differently initialised model loads the 2-way checkpoint and equals the original exactly
    original = tiny_gpt2(seed=0)
    engine = init_inference(tiny_gpt2(seed=5), dtype=torch.float, checkpoint=os.path.join(two, CONFIG_NAME),
                            save_mp_checkpoint_path=one)
    for key, value in original.state_dict().items():
        assert torch.equal(engine.module.state_dict()[key], value), key
    # 1 -> 2: the shards written again equal the first ones bit for bit, and so do the logits
    again = run_distributed(_save_at_two, world_size=2, args=(two_again, 7, one), timeout=120)
    for rank in range(2):
        assert first[rank]["state"].keys() == again[rank]["state"].keys()
        for key, value in first[rank]["state"].items():
            assert torch.equal(again[rank]["state"][key], value), (rank, key)
        assert torch.equal(again[rank]["logits"], first[rank]["logits"])
        a = torch.load(os.path.join(two, f"tp_{rank:02d}_00.pt"), weights_only=True)
        b = torch.load(os.path.join(two_again, f"tp_{rank:02d}_00.pt"), weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        torch.testing.assert_close(first[0]["logits"], original(input_ids=token_ids()).logits, **FP32)


def test_training_mp_size_checkpoint_list_is_resharded(tmp_path):
    """A model-parallel training checkpoint (one file per rank, tensors cut contiguously) loads at tp 1."""
    model = tiny_llama(seed=3)
    full = model.state_dict()
    shards: list[dict] = [{}, {}]
    for key, value in full.items():
        dim = 0 if "q_proj" in key or "up_proj" in key else 1 if "down_proj" in key else None
        for rank in range(2):
            shards[rank][key] = value.clone() if dim is None else value.chunk(2, dim=dim)[rank].clone()
    for rank in range(2):
        torch.save({"module": shards[rank]}, tmp_path / f"mp_rank_{rank:02d}_model_states.pt")
    spec = {"type": "ds_model", "version": 1.0, "checkpoints": [f"mp_rank_{r:02d}_model_states.pt" for r in (0, 1)]}
    engine = init_inference(tiny_llama(seed=4), dtype=torch.float, checkpoint=spec, base_dir=str(tmp_path),
                            training_mp_size=2)
    assert all(torch.equal(engine.module.state_dict()[k], v) for k, v in full.items())
    # the same files as a DeepSpeed checkpoint directory: mp_rank_XX files are one per rank by their name
    for size in (2, 1):
        engine = init_inference(tiny_llama(seed=4), dtype=torch.float, checkpoint=str(tmp_path),
                                training_mp_size=size)
        assert all(torch.equal(engine.module.state_dict()[k], v) for k, v in full.items())
    # a plain list without "parallelization": "tp" is, as in DeepSpeed, parts of one state dict (HF-style shards)
    keys = list(full)
    for part, chunk in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        torch.save({k: full[k] for k in chunk}, tmp_path / f"part-{part}.bin")
    parts = {"type": "ds_model", "version": 1.0, "checkpoints": ["part-0.bin", "part-1.bin"],
             "base_dir": str(tmp_path)}
    engine = init_inference(tiny_llama(seed=4), dtype=torch.float, checkpoint=parts)
    assert all(torch.equal(engine.module.state_dict()[k], v) for k, v in full.items())
    with pytest.raises(ValueError, match=r"checkpoint.type='safetensors' is not supported; accepted: 'ds_model'"):
        init_inference(tiny_llama(), dtype=torch.float, checkpoint={**parts, "type": "safetensors"})
    with pytest.raises(ValueError, match="checkpoints"):
        init_inference(tiny_llama(), dtype=torch.float, checkpoint={"type": "ds_model", "checkpoints": []})
    with pytest.raises(ValueError, match="does not exist"):
        init_inference(tiny_llama(), dtype=torch.float, checkpoint=str(tmp_path / "missing.json"))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), parallelization=st.sampled_from([None, "tp", "pp"]), mp=st.integers(1, 3),
       kind=st.sampled_from(["ds_model", "bloom", "Megatron"]))
def test_a_checkpoint_list_is_per_rank_only_when_said_so(n, parallelization, mp, kind):
    data = {"type": kind, "checkpoints": [f"f{i}.pt" for i in range(n)]}
    if parallelization:
        data["parallelization"] = parallelization
    files = [os.path.join("/ck", f) for f in data["checkpoints"]]
    per_rank, size = parallelization == "tp" or mp > 1 or kind == "Megatron", mp if mp > 1 else n
    if per_rank and n % size:
        with pytest.raises(ValueError, match=f"{n} tp files cannot be split over tp_size={size}"):
            describe_checkpoint(data, "/ck", mp)
        return
    desc = describe_checkpoint(data, "/ck", mp)
    if per_rank:  # file i belongs to rank i % size (DeepSpeed lists them part by part, rank by rank)
        assert desc.tp_files == files and not desc.non_tp_files and desc.tp_size == size
        assert all(desc.rank_files(r) == files[r::size] for r in range(size))
    else:  # parts of one state dict, loaded in turn
        assert desc.non_tp_files == files and not desc.tp_files and desc.tp_size == 1


def test_empty_meta_model_is_filled_from_the_checkpoint(tmp_path):
    model = tiny_gpt2(seed=2)
    torch.save(model.state_dict(), tmp_path / "full.pt")
    with torch.device("meta"):
        empty = tiny_gpt2(seed=3)
    engine = init_inference(empty, dtype=torch.float, checkpoint=str(tmp_path / "full.pt"), set_empty_params=True)
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=token_ids()).logits, model(input_ids=token_ids()).logits, **FP32)
    assert engine.module.lm_head.weight is engine.module.transformer.wte.weight  # still tied, stored once
    with pytest.raises(ValueError, match="no 'checkpoint'"):
        with torch.device("meta"):
            init_inference(tiny_gpt2(), dtype=torch.float)
    # the rotary inv_freq is in no checkpoint: a real one must survive the load, in a real model given
    # set_empty_params and in a meta model whose rotary embedding was built on the CPU (as the error below advises)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    llama = tiny_llama(seed=2)
    torch.save(llama.state_dict(), tmp_path / "llama.pt")
    with torch.device("meta"):
        meta_llama = tiny_llama(seed=3)
    meta_llama.model.rotary_emb = LlamaRotaryEmbedding(config=meta_llama.config)
    for target in (tiny_llama(seed=3), meta_llama):
        engine = init_inference(target, dtype=torch.float, checkpoint=str(tmp_path / "llama.pt"),
                                set_empty_params=True)
        with torch.no_grad():
            torch.testing.assert_close(engine(input_ids=token_ids()).logits, llama(input_ids=token_ids()).logits,
                                       **FP32)
    lost = r"non-persistent buffers \['model.rotary_emb.inv_freq', 'model.rotary_emb.original_inv_freq'\]"
    with pytest.raises(ValueError, match=lost):
        with torch.device("meta"):
            llama = tiny_llama()
        init_inference(llama, dtype=torch.float, checkpoint=str(tmp_path / "full.pt"))


def _train_and_save(save_dir: str) -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=tiny_gpt2(seed=6).train(), config=config)
    ids = token_ids()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="step1")
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def test_a_training_checkpoint_directory_loads_for_inference(tmp_path):
    """deepspeed.initialize -> save_checkpoint -> init_inference(checkpoint=<dir>): the trained weights."""
    trained = run_distributed(_train_and_save, world_size=1, args=(str(tmp_path),), timeout=120)[0]
    engine = init_inference(tiny_gpt2(seed=9), dtype=torch.float, checkpoint=str(tmp_path))
    for key, value in trained.items():
        assert torch.equal(engine.module.state_dict()[key], value), key
