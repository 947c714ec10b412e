"""DeepSpeed's universal-checkpoint TP internals under their names: the merge rules of
``universal_checkpoint_info`` (``deepspeed.checkpoint.tp_merge`` / ``ds_to_universal.merge_tp_slices``), the cut
back to one rank (``deepspeed.checkpoint.universal_checkpoint``), the conversion of a rule-described ZeRO-3
tensor-parallel checkpoint, and the optimizers' cached ``universal_checkpoint_info``. The merge and the cut are
checked against each other: cutting the merged tensor gives every rank exactly the slice it started with."""

from __future__ import annotations

import os
import types
from types import SimpleNamespace

import pytest
import torch

from deepspeed.checkpoint import ds_to_universal
from deepspeed.checkpoint.constants import (
    AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
    CAT_DIM,
    PARAM,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    SUB_PARAM_SHAPE,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    VOCAB_TENSOR,
    VOCABULARY_PARAMETER_PATTERNS,
)
from deepspeed.checkpoint.tp_merge import MergeRules, group_per_tp_shapes, merge_tp_slices, read_tp_slices
from deepspeed.checkpoint.universal_checkpoint import (
    SubparamShape,
    UniversalLayoutError,
    _resolve_autotp_partition,
    load_hp_checkpoint_state,
)

V = 0.4


def _param(shape, meta=None):
    param = torch.nn.Parameter(torch.zeros(shape))
    if meta is not None:
        param.ds_autotp_universal_checkpoint_meta = meta
    return param


def _gqa_slices(full, sizes, widths, dim=0):
    """Each rank's slice of a fused tensor: its width of every sub-parameter, concatenated (AutoTP's cut)."""
    slices = []
    for rank in range(len(widths[0])):
        pieces, offset = [], 0
        for size, per_rank in zip(sizes, widths, strict=True):
            pieces.append(full.narrow(dim, offset + sum(per_rank[:rank]), per_rank[rank]))
            offset += size
        slices.append(torch.cat(pieces, dim=dim))
    return slices


@pytest.mark.parametrize(("sizes", "widths"), [
    ((8, 4, 4), [[4, 4], [2, 2], [2, 2]]),           # even GQA
    ((6, 3, 3), [[4, 2], [2, 1], [2, 1]]),           # uneven heads over 2 ranks
    ((4, 2, 2), [[2, 0, 2], [1, 0, 1], [1, 0, 1]]),  # a rank owning none of it
    ((3, 1, 1), [[1, 1, 1], [1, 0, 0], [1, 0, 0]]),  # MQA over 3 ranks
])
def test_merge_then_cut_gives_every_rank_its_slice(sizes, widths):
    tp, total = len(widths[0]), sum(sizes)
    full = torch.arange(total * 3, dtype=torch.float32).view(total, 3)
    slices = _gqa_slices(full, sizes, widths)
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: V,
            PARAMETER_WITH_SUB_PARAMS: [{"patterns": [r"^qkv\.weight$"], "shape": [tuple(sizes), 3],
                                         "partition_dim": 0}],
            SUB_PARAM_SHARD_WIDTHS: {r"^qkv\.weight$": widths}}
    merged = MergeRules(info).merge("qkv.weight", slices)
    assert torch.equal(merged[PARAM], full)
    assert isinstance(merged[SUB_PARAM_SHAPE], SubparamShape)
    meta = {UNIVERSAL_CHECKPOINT_VERSION_KEY: V, "partition_dim": 0, "logical_shape": (total, 3),
            "sub_param_sizes": sizes, "sub_param_shard_widths": widths, "replicated": False}
    for rank in range(tp):
        param = _param(slices[rank].shape, meta)
        cut = _resolve_autotp_partition(param, merged, merged[PARAM], tp_rank=rank, tp_world_size=tp)
        assert torch.equal(cut, slices[rank].flatten())


def test_partition_sizes_cut_matches_row_parallel_merge():
    full = torch.arange(5 * 7, dtype=torch.float32).view(5, 7)
    slices = [full[:, :4], full[:, 4:]]  # uneven row-parallel: 4 + 3 input columns
    merged = MergeRules({PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^o\.weight$"]}).merge("o.weight", slices)
    assert merged[CAT_DIM] == 1 and torch.equal(merged[PARAM], full)
    meta = {"partition_dim": 1, "logical_shape": (5, 7), "partition_sizes": (4, 3), "replicated": False}
    for rank, expected in enumerate(slices):
        cut = _resolve_autotp_partition(_param(expected.shape, meta), merged, full, rank, 2)
        assert torch.equal(cut, expected.flatten())


def test_layout_errors_are_assertion_and_value_errors():
    with pytest.raises(UniversalLayoutError, match="differ") as caught:
        MergeRules({TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"]}).merge(
            "ln.weight", [torch.ones(4), torch.zeros(4)])
    assert isinstance(caught.value, AssertionError) and isinstance(caught.value, ValueError)
    with pytest.raises(UniversalLayoutError, match="more than one pattern"):
        MergeRules({PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^o\.", r".*weight$"]}).merge(
            "o.weight", [torch.ones(2, 2)] * 2)
    uneven = {"partition_dim": 0, "logical_shape": (10, 2), "replicated": False}
    with pytest.raises(UniversalLayoutError, match="records no partition_sizes"):
        _resolve_autotp_partition(_param((3, 2), uneven), {}, torch.zeros(10, 2), 0, 4)
    widthless = {UNIVERSAL_CHECKPOINT_VERSION_KEY: V, "partition_dim": 0, "logical_shape": (4, 2),
                 "sub_param_sizes": (2, 2), "replicated": False}
    with pytest.raises(UniversalLayoutError, match="records no sub_param_shard_widths"):
        _resolve_autotp_partition(_param((2, 2), widthless), {}, torch.zeros(4, 2), 0, 2)
    refused = {"partition_dim": 0, "logical_shape": (4, 2), "conversion": {"unsupported_reason": "interleaved"}}
    with pytest.raises(RuntimeError, match="interleaved"):
        _resolve_autotp_partition(_param((2, 2), refused), {}, torch.zeros(4, 2), 0, 2)


def test_vocabulary_rows_past_the_real_vocab_are_dropped():
    info = {VOCABULARY_PARAMETER_PATTERNS: [r"^embed\.weight$"], "original_vocab_size": 5}
    slices = [torch.ones(3, 2), torch.full((3, 2), 2.0)]  # 6 padded rows over 2 ranks
    merged = MergeRules(info).merge("embed.weight", slices)
    assert merged[VOCAB_TENSOR] is True and merged[PARAM].shape == (5, 2)
    assert torch.equal(merged[PARAM][3:], torch.full((2, 2), 2.0))


def _write_fragments(root, name, tp, state, tensor, dp=2):
    folder = root / name / str(tp)
    folder.mkdir(parents=True, exist_ok=True)
    for dp_rank, part in enumerate(tensor.reshape(-1).chunk(dp)):
        torch.save(part.clone(), folder / f"{state}.{dp_rank:02d}")


def test_merge_tp_slices_reads_fragments_and_reports_unused_patterns(tmp_path):
    full = torch.arange(24, dtype=torch.float32).view(6, 4)
    for tp, piece in enumerate(full.chunk(2)):
        for state in ("fp32", "exp_avg"):  # no exp_avg_sq (not Adam): skipped, not an error
            _write_fragments(tmp_path / "slices", "w", tp, state, piece)
        torch.save(7, tmp_path / "slices" / "w" / str(tp) / "step.00")
    info = {PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^never$"]}
    unmatched = merge_tp_slices(info, str(tmp_path / "out"), str(tmp_path / "slices"), 2,
                                ("w", [torch.Size([3, 4])] * 2))
    assert unmatched == {r"^never$"}
    assert sorted(os.listdir(tmp_path / "out" / "w")) == ["exp_avg.pt", "fp32.pt", "step.pt"]
    assert torch.equal(torch.load(tmp_path / "out" / "w" / "fp32.pt", weights_only=False)[PARAM], full)
    assert torch.load(tmp_path / "out" / "w" / "step.pt") == 7
    with pytest.raises(UniversalLayoutError, match="not empty"):  # rank 1 owns elements but wrote nothing
        read_tp_slices(str(tmp_path / "slices" / "w"), "fp32", 3, [torch.Size([3, 4])] * 3)


def test_group_per_tp_shapes_is_pipeline_major():
    files = [{"a": (2,), "t": (1,)}, {"a": (3,), "t": (1,)}, {"b": (4,), "t": (1,)}, {"b": (5,), "t": (1,)}]
    assert group_per_tp_shapes(files, pp_degree=2, tp_degree=2) == {
        "a": [(2,), (3,)], "b": [(4,), (5,)], "t": [(1,), (1,)]}
    with pytest.raises(UniversalLayoutError, match="4 model-states files"):
        group_per_tp_shapes(files, pp_degree=1, tp_degree=2)


def _zero3_tp_checkpoint(folder, shards, uc_info, dp=2):
    """A ZeRO-3 checkpoint as DeepSpeed's AutoTP writes it: file pair (dp, tp) holds, for each of tp rank's
    shards in order, the dp-th of its ceil(numel / dp) partitions (zero-padded)."""
    folder.mkdir(parents=True)
    names = list(shards)
    for tp in range(len(shards[names[0]])):
        parts = [[] for _ in range(dp)]
        for name in names:
            flat = shards[name][tp].reshape(-1)
            per = -(-flat.numel() // dp)
            flat = torch.cat([flat, flat.new_zeros(per * dp - flat.numel())])
            for rank in range(dp):
                parts[rank].append(flat[rank * per:(rank + 1) * per])
        shapes = [{name: list(shards[name][tp].shape) for name in names}]
        for rank in range(dp):
            part = torch.cat(parts[rank])
            section = {"optimizer_state_dict": {"state": {0: {"exp_avg": 2 * part, "exp_avg_sq": 3 * part}},
                                                "param_groups": [{"lr": 0.1}]},
                       "fp32_flat_groups": [part], "zero_stage": 3, "partition_count": dp}
            stem = folder / f"zero_pp_rank_{rank}_mp_rank_{tp:02d}"
            torch.save({"param_shapes": shapes, UNIVERSAL_CHECKPOINT_INFO: uc_info}, f"{stem}_model_states.pt")
            torch.save({"optimizer_state_dict": section}, f"{stem}_optim_states.pt")


def _args(src, dst, strict=True):
    return SimpleNamespace(input_folder=str(src), output_folder=str(dst), inject_missing_state=False, strict=strict,
                           keep_temp_folder=False, num_extract_workers=1, num_merge_workers=1)


def test_zero3_tensor_parallel_checkpoint_converts_by_its_rules(tmp_path):
    qkv = torch.arange(6 * 3 * 4, dtype=torch.float32).view(18, 4)  # q 6 rows, k and v 6 each: uneven heads
    sizes, widths = (6, 6, 6), [[4, 2], [4, 2], [4, 2]]
    proj = torch.arange(4 * 5, dtype=torch.float32).view(4, 5)
    norm = torch.tensor([1.0, 2.0, 3.0, 4.0])
    shards = {"qkv.weight": _gqa_slices(qkv, sizes, widths), "proj.weight": [proj[:, :3], proj[:, 3:]],
              "norm.weight": [norm, norm]}
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: V, TP_REPLICATED_PARAMETER_PATTERNS: [r"^norm\."],
            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^proj\."],
            PARAMETER_WITH_SUB_PARAMS: [{"patterns": [r"^qkv\."], "shape": [sizes, 4], "partition_dim": 0}],
            SUB_PARAM_SHARD_WIDTHS: {r"^qkv\.": widths}}
    _zero3_tp_checkpoint(tmp_path / "ckpt", shards, info)
    ds_to_universal.main(_args(tmp_path / "ckpt", tmp_path / "uc"))
    for name, full in (("qkv.weight", qkv), ("proj.weight", proj), ("norm.weight", norm)):
        for key, scale in (("fp32", 1), ("exp_avg", 2), ("exp_avg_sq", 3)):
            got = torch.load(tmp_path / "uc" / "zero" / name / f"{key}.pt", weights_only=False)
            assert torch.equal(got[PARAM], full * scale), (name, key)
    assert (tmp_path / "latest_universal").read_text() == "uc"
    common = torch.load(tmp_path / "uc" / "zero" / "optimizer_state.pt", weights_only=False)
    assert common["param_groups"] == [{"lr": 0.1}]


def test_zero3_conversion_refuses_unused_patterns_and_unsupported_layouts(tmp_path):
    shards = {"w": [torch.ones(2, 2), torch.ones(2, 2)]}
    _zero3_tp_checkpoint(tmp_path / "a", shards, {PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^typo$"]})
    with pytest.raises(ValueError, match="typo"):
        ds_to_universal.main(_args(tmp_path / "a", tmp_path / "a_uc"))
    ds_to_universal.main(_args(tmp_path / "a", tmp_path / "a_uc2", strict=False))  # a warning only
    assert torch.load(tmp_path / "a_uc2" / "zero" / "w" / "fp32.pt", weights_only=False)[PARAM].shape == (4, 2)
    _zero3_tp_checkpoint(tmp_path / "b", shards, {AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: {r"^w$": "interleaved"}})
    with pytest.raises(ValueError, match="interleaved"):
        ds_to_universal.main(_args(tmp_path / "b", tmp_path / "b_uc"))
    assert not (tmp_path / "b_uc").exists()


class _Address:
    def __init__(self, start, numel):
        self.start, self.numel = start, numel


def test_load_hp_checkpoint_state_fills_this_ranks_fragment(tmp_path):
    """Rank 1 of 2 of a row-parallel weight whose fp32 partition holds elements 2..5 of its (2, 4) slice."""
    full = torch.arange(16, dtype=torch.float32).view(2, 8)
    torch.save({PARAM: full, CAT_DIM: 1}, tmp_path / "fp32.pt")
    torch.save({PARAM: 10 * full, CAT_DIM: 1}, tmp_path / "exp_avg.pt")
    torch.save(torch.tensor(3), tmp_path / "step.pt")
    param = _param((2, 4))
    master = torch.zeros(4)
    param._hp_mapping = SimpleNamespace(lp_fragment_address=_Address(2, 4), optim_fragment={},
                                        get_hp_fragment=lambda: master)
    param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)
    step = param.load_hp_checkpoint_state(str(tmp_path), tp_rank=1, tp_world_size=2)
    expected = full[:, 4:].flatten()[2:6]
    assert int(step) == 3
    assert torch.equal(master, expected)
    assert torch.equal(param._hp_mapping.optim_fragment["exp_avg"], 10 * expected)
    with pytest.raises(UniversalLayoutError, match="numel"):
        param.load_hp_checkpoint_state(str(tmp_path), tp_rank=0, tp_world_size=3)


def test_optimizers_cache_the_parameters_universal_checkpoint_info():
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from ds_zero.stage_1_and_2 import DeepSpeedZeroOptimizer, ZeroSettings

    model = torch.nn.Linear(4, 2)
    info = {PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^weight$"]}
    model.weight.universal_checkpoint_info = info
    params = list(model.parameters())
    names = {p: n for n, p in model.named_parameters()}
    zero = DeepSpeedZeroOptimizer(torch.optim.SGD(params, lr=0.1), params, names, ZeroSettings(stage=2))
    del model.weight.universal_checkpoint_info
    assert zero._get_universal_checkpoint_info() is info
    assert zero.bit16_groups == [params]
    assert zero.state_dict()[UNIVERSAL_CHECKPOINT_INFO] is info
    bf16 = object.__new__(BF16_Optimizer)
    bf16.bf16_groups = [[_param((2,))]]
    bf16._enable_universal_checkpoint()
    assert bf16._get_universal_checkpoint_info() is None


def test_autotp_layouts_become_deepspeed_rules_that_merge_like_the_layouts():
    """Our AutoTP checkpoints also carry DeepSpeed's rules (for its converter): merging by them gives what merging
    by our exact layouts gives; a layout they cannot express is marked unsupported."""
    from deepspeed.checkpoint.autotp_universal import assemble, universal_checkpoint_info
    from deepspeed.checkpoint.constants import AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS as UNSUPPORTED

    layouts = {
        "qkv.weight": {"dim": 0, "full": 12, "pieces": [[[0, 4], [6, 2], [9, 2]], [[4, 2], [8, 1], [11, 1]]]},
        "o.weight": {"dim": 1, "full": 7, "pieces": [[[0, 4]], [[4, 3]]]},
        "up.weight": {"dim": 0, "full": 5, "pieces": [[[0, 3]], [[3, 2]]]},
        "odd.weight": {"dim": 0, "full": 4, "pieces": [[[2, 2]], [[0, 2]]]},  # rank 1 holds the first half
    }
    fulls = {"qkv.weight": torch.randn(12, 5), "o.weight": torch.randn(5, 7), "up.weight": torch.randn(5, 5),
             "norm.weight": torch.randn(5)}
    shapes = {"qkv.weight": (8, 5), "o.weight": (5, 4), "up.weight": (3, 5), "odd.weight": (2, 5), "norm.weight": (5,)}
    info = universal_checkpoint_info(layouts, shapes)
    assert info[TP_REPLICATED_PARAMETER_PATTERNS] == [r"^norm\.weight$"]
    assert info[PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] == [r"^o\.weight$"]
    assert info[SUB_PARAM_SHARD_WIDTHS] == {r"^qkv\.weight$": [[4, 2], [2, 1], [2, 1]]}
    assert list(info[UNSUPPORTED]) == [r"^odd\.weight$"]
    rules = MergeRules(info)
    for name, full in fulls.items():
        layout = layouts.get(name)
        if layout is None:
            slices = [full, full]
        else:
            slices = [torch.cat([full.narrow(layout["dim"], s, n) for s, n in rank], dim=layout["dim"])
                      for rank in layout["pieces"]]
        assert torch.equal(rules.merge(name, slices)[PARAM], assemble(slices, layout)), name
        assert torch.equal(assemble(slices, layout), full)


def _save_autotp_gpt2(save_dir: str) -> bool:
    from _autotp_models import tiny, without_tp_plan

    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}
    engine = deepspeed.initialize(model=without_tp_plan(tiny("gpt2").train()), config=config)[0]
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    engine.backward(engine(input_ids=tokens, labels=tokens, use_cache=False).loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    return True


def test_our_autotp_checkpoint_converts_without_injected_state_and_its_rules_agree(tmp_path):
    """An AutoTP gpt2 (fused QKV in Conv1D) ZeRO-1 checkpoint: ds_to_universal needs no --inject_missing_state,
    and a conversion by the DeepSpeed rules it carries alone (strict: every pattern used) writes the same files
    as ours by the exact layouts."""
    from _harness import run_distributed

    from deepspeed.checkpoint.autotp_universal import convert_tp_by_rules

    assert run_distributed(_save_autotp_gpt2, world_size=2, args=(str(tmp_path),), timeout=120) == [True, True]
    tag = str(tmp_path / "t")
    ds_to_universal.main(["--input_folder", tag, "--output_folder", str(tmp_path / "by_layouts")])
    info = torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=True)[UNIVERSAL_CHECKPOINT_INFO]
    assert info[SUB_PARAM_SHARD_WIDTHS] and not info.get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS)
    convert_tp_by_rules(tag, str(tmp_path / "by_rules"), [0, 1], info, strict=True)
    names = sorted(os.listdir(tmp_path / "by_rules" / "zero"))
    assert "transformer.h.0.attn.c_attn.weight" in names
    for name in names:
        if name.endswith(".pt"):
            continue
        for file in sorted(os.listdir(tmp_path / "by_rules" / "zero" / name)):
            ours = torch.load(tmp_path / "by_layouts" / "zero" / name / file, weights_only=True)
            rules = torch.load(tmp_path / "by_rules" / "zero" / name / file, weights_only=True)
            if isinstance(ours, dict):
                ours, rules = ours[PARAM], rules[PARAM]
            assert torch.equal(ours, rules), (name, file)
