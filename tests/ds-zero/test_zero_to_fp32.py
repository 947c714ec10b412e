"""``ds_zero.zero_to_fp32``: rebuild fp32 weights from hand-written ZeRO stage 1/2/3 checkpoints.

The helper below writes DeepSpeed's on-disk layout directly (model states + one optimizer file per rank,
flat fp32 partitions padded to 2*world_size), with 16-bit copies in ``module`` so that reading the wrong
source shows up as a bf16 rounding difference.
"""

from __future__ import annotations

import enum
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import types
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ds_zero import zero_to_fp32 as z2f

LOW = torch.bfloat16
TAG = "global_step5"


class Net(torch.nn.Module):
    """Two param groups' worth of params, a tied weight, a frozen layer and float + int buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(7, 5)
        self.lin = torch.nn.Linear(5, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.frozen = torch.nn.Linear(3, 2)
        self.head = torch.nn.Linear(5, 7, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.frozen.requires_grad_(False)
        with torch.no_grad():
            for param in self.parameters():
                param.normal_()  # values bf16 cannot hold exactly
            self.norm.running_mean.normal_()
            self.norm.num_batches_tracked.fill_(9)


def _fake_deepspeed_classes() -> types.ModuleType:
    """Stand-ins for DeepSpeed classes that real checkpoints pickle (absent when the file is read)."""
    module = types.ModuleType("fake_ds_runtime")

    class ZeroStageEnum(enum.IntEnum):
        optimizer_states = 1
        gradients = 2
        weights = 3

    class LossScaler:
        def __init__(self) -> None:
            self.cur_scale = 1024.0

    for cls in (ZeroStageEnum, LossScaler):
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
    return module


def _split_stage3(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    part = math.ceil(flat.numel() / world)
    padded = torch.cat([flat, torch.full((part * world - flat.numel(),), 555.0, dtype=flat.dtype)])
    return list(padded.split(part))


def _stage12_partitions(named: dict, groups: list[list[str]], world: int) -> list[list[torch.Tensor]]:
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for group in groups:
        flat = torch.cat([named[name].detach().float().reshape(-1) for name in group])
        padded = 2 * world * math.ceil(flat.numel() / (2 * world))
        flat = torch.cat([flat, torch.full((padded - flat.numel(),), 777.0)])
        for rank, part in enumerate(flat.split(padded // world)):
            per_rank[rank].append(part.clone())
    return per_rank


def _stage3_partitions(named: dict, groups: list[list[str]], world: int) -> list[list[torch.Tensor]]:
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for group in groups:
        slices = [_split_stage3(named[name].detach().float().reshape(-1), world) for name in group]
        for rank in range(world):
            per_rank[rank].append(torch.cat([pieces[rank] for pieces in slices]))
    return per_rank


def write_checkpoint(root, model: torch.nn.Module, world: int, stage: int = 2, tag: str = TAG,
                     latest: bool = True, groups: list[list[str]] | None = None, bf16_optimizer: bool = False) -> str:
    """Write ``model`` as a ZeRO checkpoint under ``root/tag``; returns the tag directory.

    ``bf16_optimizer``: name the rank files ``bf16_zero_pp_rank_*`` and leave out ``zero_stage``, as
    DeepSpeed's BF16_Optimizer (stage 0/1 layout) does."""
    tag_dir = os.path.join(root, tag)
    os.makedirs(tag_dir, exist_ok=True)
    named = dict(model.named_parameters())
    trainable = [name for name, param in named.items() if param.requires_grad]
    frozen = [name for name, param in named.items() if not param.requires_grad]
    groups = groups or [trainable[:2], trainable[2:]]
    every = dict(model.named_parameters(remove_duplicate=False))
    shared = [[alias, next(n for n in named if named[n] is p)] for alias, p in every.items() if alias not in named]
    module = {k: (v.to(LOW) if v.is_floating_point() else v).clone() for k, v in model.state_dict().items()}
    fake = _fake_deepspeed_classes()
    sys.modules[fake.__name__] = fake
    try:
        base = {"buffer_names": [name for name, _ in model.named_buffers()],
                "param_shapes": [{name: named[name].shape for name in group} for group in groups],
                "frozen_param_shapes": {name: named[name].shape for name in frozen} or None,
                "shared_params": shared, "ds_version": "0.1.0", "dp_world_size": world, "optimizer": None,
                "sparse_tensor_module_names": set(), "global_steps": 5}
        if stage == 3:
            partitions = _stage3_partitions(named, groups, world)
            for rank in range(world):
                fragments = {name: _split_stage3(named[name].detach().to(LOW).reshape(-1), world)[rank]
                             for name in frozen}
                states = dict(base, module=module, frozen_param_fragments=fragments)
                torch.save(states, os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
        else:
            partitions = _stage12_partitions(named, groups, world)
            fragments = {name: named[name].detach().to(LOW).clone() for name in frozen}
            states = dict(base, module=module, frozen_param_fragments=fragments or None)
            torch.save(states, os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        for rank in range(world):
            optim = {"zero_stage": fake.ZeroStageEnum(stage), "partition_count": [world] * len(groups),
                     key: partitions[rank], "loss_scaler": fake.LossScaler(),
                     "base_optimizer_state": {"state": {}, "param_groups": [{"lr": 0.1}]}}
            if bf16_optimizer:
                del optim["zero_stage"]
            name = f"{'bf16_' if bf16_optimizer else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            torch.save({"optimizer_state_dict": optim, "ds_config": {"train_batch_size": 8}, "ds_version": "0.1.0"},
                       os.path.join(tag_dir, name))
    finally:
        del sys.modules[fake.__name__]
    if latest:
        with open(os.path.join(root, "latest"), "w") as handle:
            handle.write(tag)
    return tag_dir


def expected_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the conversion must give: fp32 masters; frozen params and buffers as saved (bf16), in fp32."""
    trainable = {name for name, param in model.named_parameters(remove_duplicate=False) if param.requires_grad}
    out = {}
    for name, value in model.state_dict().items():
        if name not in trainable and value.is_floating_point():
            value = value.to(LOW)
        out[name] = value.float() if value.is_floating_point() else value
    return out


def assert_state_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name


@pytest.fixture
def model() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize(("stage", "world"), [(2, 1), (2, 2), (2, 3), (1, 2), (3, 2), (3, 3)])
def test_state_dict_matches_the_model(tmp_path, model, stage, world):
    write_checkpoint(tmp_path, model, world, stage=stage)
    state = z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert_state_equal(state, expected_state(model))
    assert state["head.weight"] is state["emb.weight"]  # tied: one tensor under both names
    assert state["norm.num_batches_tracked"].dtype == torch.int64


def test_bf16_optimizer_files_without_zero_stage(tmp_path, model):
    write_checkpoint(tmp_path, model, 2, stage=1, bf16_optimizer=True)
    assert_state_equal(z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path), expected_state(model))


def test_explicit_tag_and_excluding_frozen(tmp_path, model):
    write_checkpoint(tmp_path, model, 2, tag="step_a", latest=False)
    state = z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="step_a", exclude_frozen_parameters=True)
    want = {k: v for k, v in expected_state(model).items() if not k.startswith("frozen.")}
    assert_state_equal(state, want)


def test_lazy_mode_reads_on_contiguous(tmp_path, model, monkeypatch):
    write_checkpoint(tmp_path, model, 3)
    read: list[str] = []
    monkeypatch.setattr(z2f, "_materialise_observer", lambda name, tensor: read.append(name))
    lazy = z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path, lazy_mode=True)
    assert read == [] and all(isinstance(v, z2f.LazyTensor) for v in lazy.values())
    assert lazy["lin.weight"].shape == (3, 5) and lazy["lin.weight"].dtype == torch.float32
    assert lazy["lin.weight"].nbytes == 60 and "lin.weight" in repr(lazy["lin.weight"])
    got = {name: value.contiguous() for name, value in lazy.items()}
    assert_state_equal(got, expected_state(model))
    assert len(read) == len(lazy)


def test_load_state_dict_from_zero_checkpoint(tmp_path, model):
    write_checkpoint(tmp_path, model, 2)
    torch.manual_seed(1)
    fresh = Net()
    loaded = z2f.load_state_dict_from_zero_checkpoint(fresh, tmp_path)
    assert loaded is fresh and loaded.head.weight is loaded.emb.weight
    assert_state_equal({k: (v.float() if v.is_floating_point() else v) for k, v in loaded.state_dict().items()},
                       expected_state(model))

    other = torch.nn.Linear(2, 2)
    with pytest.raises(z2f.ZeroToFp32Error, match="entries the model does not have"):
        z2f.load_state_dict_from_zero_checkpoint(other, tmp_path)


def _read_output(output_dir, safe: bool) -> tuple[dict, list[str]]:
    files = sorted(os.listdir(output_dir))
    state = {}
    for name in files:
        path = os.path.join(output_dir, name)
        if name.endswith(".bin"):
            state.update(torch.load(path, weights_only=True))
        elif name.endswith(".safetensors"):
            from safetensors.torch import load_file

            state.update(load_file(path))
    return state, files


def test_convert_one_file_then_shards_with_index(tmp_path, model):
    write_checkpoint(tmp_path / "ckpt", model, 2)
    out = tmp_path / "out"
    z2f.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out)
    state, files = _read_output(out, safe=False)
    assert files == ["pytorch_model.bin"]
    want = expected_state(model)
    assert_state_equal({k: state[k] for k in want}, want)

    z2f.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, max_shard_size="200B")
    state, files = _read_output(out, safe=False)
    shards = [f for f in files if f.endswith(".bin")]
    assert "pytorch_model.bin" not in files  # the stale single file would shadow the shards
    assert len(shards) > 2 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(want) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())
    assert_state_equal({k: state[k] for k in want}, want)
    for name in shards:  # shards respect the size limit unless a single tensor is larger
        tensors = torch.load(out / name, weights_only=True)
        size = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors.values()}.values())
        assert size <= 200 or len(tensors) == 1

    z2f.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, max_shard_size=None)
    assert sorted(os.listdir(out)) == ["pytorch_model.bin"]  # stale shards and index removed


def test_convert_safetensors(tmp_path, model):
    pytest.importorskip("safetensors")
    write_checkpoint(tmp_path / "ckpt", model, 3, stage=3)
    want = expected_state(model)
    for shard_size, expect_index in (("5GB", False), (150, True)):
        out = tmp_path / f"out{shard_size}"
        z2f.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, max_shard_size=shard_size,
                                                       safe_serialization=True)
        state, files = _read_output(out, safe=True)
        assert ("model.safetensors.index.json" in files) == expect_index
        assert ("model.safetensors" in files) == (not expect_index)
        assert_state_equal({k: state[k] for k in want}, want)
        if expect_index:
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())


def test_safetensors_missing_is_a_clear_error(tmp_path, model, monkeypatch):
    write_checkpoint(tmp_path / "ckpt", model, 1)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(z2f.ZeroToFp32Error, match="pip install safetensors"):
        z2f.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out", safe_serialization=True)
    assert not (tmp_path / "out").exists()


def test_conversion_holds_about_one_shard_plus_largest_param(tmp_path, monkeypatch):
    """Count materialised bytes alive at once (weakref finalizers): bounded by shard + largest param."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(25, 40, bias=False) for _ in range(12)] + [torch.nn.Linear(50, 80, bias=False)]
    big = torch.nn.Sequential(*layers)
    names = [name for name, _ in big.named_parameters()]
    write_checkpoint(tmp_path / "ckpt", big, 2, groups=[names[:7], names[7:]])
    total = sum(p.numel() * 4 for p in big.parameters())
    largest, shard = 50 * 80 * 4, 10_000
    live = {"now": 0, "peak": 0}

    def release(nbytes):
        live["now"] -= nbytes

    def observe_exact(name, tensor):
        live["now"] += tensor.nbytes
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(tensor, release, tensor.nbytes)

    monkeypatch.setattr(z2f, "_materialise_observer", observe_exact)
    z2f.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out", max_shard_size=shard)
    assert len(os.listdir(tmp_path / "out")) > 5
    assert live["now"] == 0 and live["peak"] <= shard + largest and live["peak"] < total / 2

    live["peak"] = 0  # the same measure sees the eager state dict hold the whole model
    state = z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert live["peak"] == total
    del state


def test_script_runs_alone_from_a_copied_file(tmp_path, model):
    """The file copied into a checkpoint folder runs with our packages unimportable."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, model, 2)
    shutil.copy(z2f.__file__, ckpt / "zero_to_fp32.py")
    runner = textwrap.dedent("""
        import importlib.abc, runpy, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"ds_zero", "ds_config", "ds_ops", "deepspeed"}:
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        sys.argv = ["zero_to_fp32.py"] + sys.argv[1:]
        runpy.run_path("zero_to_fp32.py", run_name="__main__")
    """)
    args = [".", str(tmp_path / "out"), "-t", TAG, "--max_shard_size", "200B", "--exclude_frozen_parameters"]
    done = subprocess.run([sys.executable, "-c", runner, *args], cwd=ckpt, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "zero stage 2, world_size: 2" in done.stderr + done.stdout
    state, files = _read_output(tmp_path / "out", safe=False)
    assert "pytorch_model.bin.index.json" in files and "frozen.weight" not in state
    assert torch.equal(state["lin.weight"], model.lin.weight)


def test_module_imports_only_stdlib_and_torch():
    import ast

    tree = ast.parse(open(z2f.__file__).read())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert top - {"__future__"} <= set(sys.stdlib_module_names) | {"torch"}, top


def test_main_exit_codes(tmp_path, model, capsys):
    write_checkpoint(tmp_path / "ckpt", model, 1)
    assert z2f.main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--safe_serialization"]) == 0
    assert z2f.main(["--help"]) == 0
    assert "--max_shard_size" in capsys.readouterr().out
    assert z2f.main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert z2f.main([str(tmp_path / "ckpt")]) == 2


def test_bad_checkpoints_raise_clear_errors(tmp_path, model):
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    tag_dir = write_checkpoint(tmp_path, model, 3)
    with pytest.raises(FileNotFoundError, match="nope"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="nope")
    with pytest.raises(FileNotFoundError, match="looks like a tag folder"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tag_dir)

    os.rename(os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt"), os.path.join(tmp_path, "r1"))
    with pytest.raises(z2f.ZeroToFp32Error, match=r"3 data-parallel ranks.*missing ranks \[1\]"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path)

    with open(os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt"), "wb") as handle:
        handle.write(b"not a checkpoint")
    with pytest.raises(z2f.ZeroToFp32Error, match="cannot read checkpoint file .*zero_pp_rank_1_mp_rank_00"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path)

    for rank in range(3):
        os.remove(os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    with pytest.raises(z2f.ZeroToFp32Error, match="not a ZeRO"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path)


def test_model_parallel_checkpoints_are_refused(tmp_path, model):
    tag_dir = write_checkpoint(tmp_path, model, 1)
    source = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    shutil.copy(source, os.path.join(tag_dir, "mp_rank_01_model_states.pt"))
    with pytest.raises(z2f.ZeroToFp32Error, match=r"model-parallel rank 1.*not supported"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path)


def test_partition_size_mismatch_names_the_group(tmp_path, model):
    write_checkpoint(tmp_path, model, 2)
    path = os.path.join(tmp_path, TAG, "mp_rank_00_model_states.pt")
    states = torch.load(path, weights_only=False)
    states["param_shapes"][1]["extra"] = torch.Size([40])
    torch.save(states, path)
    with pytest.raises(z2f.ZeroToFp32Error, match=r"param group 1: the 2 rank partitions hold 12 .* need 49"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path)


@given(st.integers(min_value=1, max_value=10**13), st.sampled_from(["", "B", "KB", "MB", "gb", "GiB", "kib"]))
def test_parse_size(number, unit):
    scale = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "GIB": 2**30, "KIB": 2**10}[unit.upper()]
    assert z2f._parse_size(f"{number}{unit}") == number * scale
    assert z2f._parse_size(number) == number


@pytest.mark.parametrize("bad", ["5 parsecs", "", "GB", "-1GB", 0, True, "0MB"])
def test_parse_size_rejects(bad):
    with pytest.raises(z2f.ZeroToFp32Error, match="max_shard_size"):
        z2f._parse_size(bad)


_RSS_PROBE = """
import sys, threading, time
from ds_zero import zero_to_fp32 as z2f

def anon_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))

def peak_increase(fn):
    base, peak, stop = anon_kib(), [0], threading.Event()
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], anon_kib())
            time.sleep(0.002)
    thread = threading.Thread(target=sample)
    thread.start()
    result = fn()
    stop.set()
    thread.join()
    return (max(peak[0], anon_kib()) - base) * 1024, result

ckpt, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
converted, _ = peak_increase(lambda: z2f.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size=shard))
eager, state = peak_increase(lambda: z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt))
print(converted, eager)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RssAnon from /proc/self/status")
def test_conversion_resident_memory_stays_near_one_shard(tmp_path):
    """Real memory: anonymous RSS (mmap'd checkpoint pages excluded) while converting a 128 MB model.

    The model is large enough that the allocator's and the first call's own few MB stay well inside the margin
    (a 48 MB model measured 20-24 MB, too close to its bound)."""
    torch.manual_seed(0)
    big = torch.nn.Sequential(*[torch.nn.Linear(1414, 1414, bias=False) for _ in range(16)])  # 16 x 8 MB
    names = [name for name, _ in big.named_parameters()]
    write_checkpoint(tmp_path / "ckpt", big, 2, groups=[names[:8], names[8:]])
    total, shard = 16 * 1414 * 1414 * 4, 16_000_000
    done = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(tmp_path / "ckpt"), str(tmp_path / "out"),
                           str(shard)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    converted, eager = map(int, done.stdout.split())
    # one full shard (2 params) plus the param that overflows it: ~24 MB, up to 40 MB measured when the heap has
    # not yet handed back the previous shard's pages (a loaded 2-core CI run); loading it all would be >= 128 MB
    assert converted < 0.4 * total, (converted, eager)
    # the same probe sees the eager state dict hold the model (less what the heap kept from the conversion)
    assert eager > 0.6 * total, (converted, eager)
