"""ZeRO stages 1 and 2 options through ``deepspeed.initialize``: the reduction and gather options (buckets,
reduce vs all-reduce, broadcast gather, round robin), unused parameters, ``no_sync``, ``coalesce_grad_reduction``
(counted collectives), the options rejected with a ``ConfigError`` and the engine's ZeRO accessors.

The model, data, rank body and reference are shared with ``test_stage_1_and_2.py``."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

# pytest's importlib mode gives this folder no package: load the sibling module by path (and register it, so
# the harness can send its functions to the ranks)
_NAME = "_ds_zero_stage_1_and_2_common"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).with_name("test_stage_1_and_2.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)
common = sys.modules[_NAME]
ADAMW, BASE, IN, OUT = common.ADAMW, common.BASE, common.IN, common.OUT
make_model, reference_run, rel_error, zero_config = (common.make_model, common.reference_run, common.rel_error,
                                                      common.zero_config)



def _engine_run(config: dict, run: dict) -> dict:
    # the harness sends functions of this (pytest-loaded) module by file; the sibling module's by name fails
    return common.engine_run(config, run)


def train(config: dict, world: int, **run) -> list[dict]:
    return run_distributed(_engine_run, world_size=world, args=(config, run), timeout=60)


COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
               "batch_isend_irecv")


@contextlib.contextmanager
def counting_collectives() -> Iterator[Counter]:
    """Count the torch.distributed collectives issued inside the block (patched on the module, restored after:
    the harness reuses worker processes)."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _collectives_body(zero: dict) -> dict:
    """One training step (one backward) with ``zero``: the collectives of the backward and of the step."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=make_model(), config=zero_config(zero))
    x = torch.randn(2, IN)
    with counting_collectives() as backward:
        engine.backward(engine(x).pow(2).mean())
    with counting_collectives() as step:
        engine.step()
    return {"backward": dict(backward), "step": dict(step), "buckets": len(engine.optimizer.reducer.buckets)}


# ---- reduction and gather options -------------------------------------------------------------------------
OPTIONS = {
    "reduce_scatter_false": {"reduce_scatter": False},
    "per_owner_reduce": {"use_multi_rank_bucket_allreduce": False},
    "small_buckets": {"reduce_bucket_size": 20, "allgather_bucket_size": 16},
    "broadcast_gather": {"allgather_partitions": False, "allgather_bucket_size": 30},
    "not_contiguous": {"contiguous_gradients": False, "reduce_bucket_size": 50},
    "round_robin": {"round_robin_gradients": True},
    "overlap_small_per_owner": {"overlap_comm": True, "use_multi_rank_bucket_allreduce": False,
                                "reduce_bucket_size": 30},
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_and_gather_options_match_reference(stage, option):
    got = train(zero_config({"stage": stage, **OPTIONS[option]}, gradient_clipping=common.CLIP), 2, gas=2, steps=10)
    ref = reference_run({"batch": 8, "steps": 10}, clip=common.CLIP)
    for r in got:
        assert rel_error(r["state"], ref["state"]) <= 1e-5
    assert got[0]["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    if "reduce_bucket_size" in OPTIONS[option]:
        assert got[0]["buckets"] > 1


@pytest.mark.parametrize("stage", [1, 2])
def test_all_options_together_on_four_ranks(stage):
    zero = {"stage": stage, "overlap_comm": True, "use_multi_rank_bucket_allreduce": False, "reduce_bucket_size": 25,
            "allgather_partitions": False, "allgather_bucket_size": 6, "round_robin_gradients": True,
            "contiguous_gradients": False}
    got = train(zero_config(zero, gradient_clipping=common.CLIP), 4, gas=3, steps=10)
    ref = reference_run({"batch": 24, "steps": 10}, clip=common.CLIP)
    for r in got:
        assert rel_error(r["state"], ref["state"]) <= 1e-5


def test_collectives_follow_the_options():
    def run(zero):
        return run_distributed(_collectives_body, world_size=2, args=(zero,), timeout=60)[0]

    # one bucket: one point-to-point exchange in backward (gloo); the step: the norm, then a p2p gather
    plain = run({"stage": 2})
    assert plain["buckets"] == 1 and plain["backward"] == {"batch_isend_irecv": 1}
    assert plain["step"] == {"all_reduce": 1, "batch_isend_irecv": 1}
    small = run({"stage": 2, "reduce_bucket_size": 20, "allgather_bucket_size": 16})
    assert small["buckets"] > 1 and small["backward"] == {"batch_isend_irecv": small["buckets"]}
    assert small["step"] == {"all_reduce": 1, "batch_isend_irecv": 4}  # ceil(62 / 16) chunks of a partition
    everyone = run({"stage": 2, "reduce_scatter": False})
    assert everyone["backward"] == {"all_reduce": 1}
    per_owner = run({"stage": 2, "use_multi_rank_bucket_allreduce": False})
    assert per_owner["backward"].get("all_reduce", 0) == 0 and per_owner["backward"]["reduce"] >= 2
    broadcast = run({"stage": 1, "allgather_partitions": False})
    assert broadcast["backward"] == {"batch_isend_irecv": 1}  # stage 1, GAS 1: every backward is a boundary
    assert broadcast["step"] == {"all_reduce": 1, "broadcast": 2}  # the norm, then one broadcast per owner


def _comms_logger_body(zero: dict) -> dict:
    """One step with the comms logger on: what it recorded (ZeRO's collectives go through deepspeed.comm)."""
    import deepspeed
    from deepspeed import comm
    from ds_config import CommsLoggerConfig

    comm.comms_logger.reset()
    try:
        config = zero_config(zero, comms_logger={"enabled": True, "prof_all": True})
        engine, _, _, _ = deepspeed.initialize(model=make_model(), config=config)
        engine.backward(engine(torch.randn(2, IN)).pow(2).mean())
        engine.step()
        logged = {op: sum(r.count for r in sizes.values()) for op, sizes in comm.comms_logger.comms_dict.items()}
        table = comm.log_summary()
    finally:
        comm.configure(CommsLoggerConfig())
        comm.comms_logger.reset()
    return {"logged": logged, "table": table, "buckets": len(engine.optimizer.reducer.buckets)}


def test_comms_logger_records_zero_collectives():
    def run(zero):
        return run_distributed(_comms_logger_body, world_size=2, args=(zero,), timeout=60)[0]

    # overlapped buckets: every bucket's exchange, then the norm's all-reduce and the weight gather
    overlapped = run({"stage": 2, "overlap_comm": True, "reduce_bucket_size": 20})
    assert overlapped["buckets"] > 1
    assert overlapped["logged"].get("batch_isend_irecv") == overlapped["buckets"] + 1, overlapped["logged"]
    assert overlapped["logged"].get("all_reduce", 0) >= 1 and "batch_isend_irecv" in overlapped["table"]
    per_owner = run({"stage": 1, "use_multi_rank_bucket_allreduce": False, "allgather_partitions": False})
    assert per_owner["logged"].get("reduce", 0) >= 2 and per_owner["logged"].get("broadcast") == 2, per_owner


# ---- unused parameters ----------------------------------------------------------------------------------
NO_DECAY = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}}


def _unused_error_body() -> str:
    import deepspeed

    config = zero_config({"stage": 2, "ignore_unused_parameters": False})
    engine, _, _, _ = deepspeed.initialize(model=make_model("unused"), config=config)
    with pytest.raises(RuntimeError) as info:
        engine.backward(engine(torch.randn(2, IN)).pow(2).mean())
    return str(info.value)


def test_unused_parameter_without_ignore_is_a_clear_error():
    for message in run_distributed(_unused_error_body, world_size=2, timeout=60):
        assert "ignore_unused_parameters" in message and "(3, 3)" in message


def test_unused_parameter_with_ignore_trains():
    got = train(zero_config({"stage": 2, "ignore_unused_parameters": True}, optimizer=NO_DECAY), 2, kind="unused",
                steps=10)
    ref = reference_run({"batch": 4, "steps": 10, "kind": "unused", "weight_decay": 0.0})
    init = make_model("unused").state_dict()
    assert torch.equal(got[0]["state"]["unused.weight"], init["unused.weight"])
    assert rel_error(got[0]["state"], ref["state"]) <= 1e-5


# ---- no_sync --------------------------------------------------------------------------------------------
def _no_sync_body(stage: int, gas: int, steps: int) -> dict:
    """Each step: every backward but the last runs inside no_sync (GAS ``gas``: one engine.step() per micro batch;
    GAS 1: several backward calls, then one step). Returns the weights and whether the gradients of a no_sync
    backward differed between ranks (local accumulation)."""
    import deepspeed

    rank, world, chunks = dist.get_rank(), dist.get_world_size(), 3
    config = {**zero_config({"stage": stage}), "gradient_accumulation_steps": gas}
    engine, _, _, _ = deepspeed.initialize(model=make_model(), config=config)
    micros = gas if gas > 1 else chunks
    local_differs = []
    for x, y in common.batches("mlp", steps, 2 * micros * world):
        for m in range(micros):
            lo = (m * world + rank) * 2
            last = m == micros - 1
            with contextlib.nullcontext() if last else engine.no_sync():
                engine.backward(torch.nn.functional.mse_loss(engine(x[lo:lo + 2]), y[lo:lo + 2]))
            if not last:
                grad = engine.module[0].weight.grad.clone()
                others = [torch.empty_like(grad) for _ in range(world)]
                dist.all_gather(others, grad)
                local_differs.append(not torch.equal(others[0], others[-1]))
            if gas > 1 or last:
                engine.step()
    return {"state": {k: v.clone() for k, v in engine.module.state_dict().items()}, "local": local_differs}


@pytest.mark.parametrize("gas", [3, 1])
def test_no_sync_stage1_matches_stage0(gas):
    steps = 6
    got = run_distributed(_no_sync_body, world_size=2, args=(1, gas, steps), timeout=60)
    base = run_distributed(_no_sync_body, world_size=2, args=(0, gas, steps), timeout=60)
    assert all(got[0]["local"]) and all(base[0]["local"])  # inside no_sync nothing was reduced
    assert rel_error(got[0]["state"], base[0]["state"]) <= 1e-6
    assert rel_error(got[1]["state"], got[0]["state"]) == 0.0
    # GAS 3: plain gradient accumulation; GAS 1: three backward calls sum three chunk-mean gradients
    ref = reference_run({"batch": 12, "steps": steps, "loss_factor": 1.0 if gas > 1 else 3.0})
    assert rel_error(got[0]["state"], ref["state"]) <= 1e-5


def _no_sync_stage2_body() -> str:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=make_model(), config=zero_config({"stage": 2}))
    with pytest.raises(AssertionError) as info, engine.no_sync():
        pass
    return str(info.value)


def test_no_sync_raises_for_stage2():
    message = run_distributed(_no_sync_stage2_body, world_size=1, timeout=60)[0]
    assert "no_sync" in message and "stage 2" in message


# ---- coalesce_grad_reduction ------------------------------------------------------------------------------
EXACT_IN, EXACT_OUT = 8, 4
SGD_EXACT = {"type": "SGD", "params": {"lr": 2.0 ** -6}}


def _exact_problem(steps: int, batch: int) -> tuple[torch.nn.Module, list]:
    """A linear model, weights k/8 and integer data: every gradient and every sum of gradients is exact in fp32
    for a few SGD steps (lr 2**-6, loss = sum of squares), so the order of the reductions cannot change a bit."""
    model = torch.nn.Linear(EXACT_IN, EXACT_OUT)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model.weight.copy_(torch.randint(-4, 5, model.weight.shape, generator=gen) / 8)
        model.bias.copy_(torch.randint(-4, 5, model.bias.shape, generator=gen) / 8)
    data = [(torch.randint(-2, 3, (batch, EXACT_IN), generator=gen).float(),
             torch.randint(-2, 3, (batch, EXACT_OUT), generator=gen).float()) for _ in range(steps)]
    return model, data


def _coalesce_body(stage: int, coalesce: bool, steps: int, zero: dict, exact: bool = False) -> dict:
    """GAS 1, three backward calls (chunks of this rank's micro batch) per step, inside coalesce_grad_reduction or
    not; counts the gradient collectives (all-reduce/reduce) issued by the backward calls of each window.
    ``exact``: the exactly representable problem with SGD; else the MLP with AdamW (mean-squared-error chunks)."""
    import deepspeed

    rank, world, chunks = dist.get_rank(), dist.get_world_size(), 3
    if exact:
        model, data = _exact_problem(steps, 2 * chunks * world)
        config = zero_config({"stage": stage, **zero}, optimizer=SGD_EXACT, zero_allow_untested_optimizer=True)
    else:
        model, data = make_model(), common.batches("mlp", steps, 2 * chunks * world)
        config = zero_config({"stage": stage, **zero})
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    counts = []
    for x, y in data:
        xs, ys = x[rank * 2 * chunks:(rank + 1) * 2 * chunks], y[rank * 2 * chunks:(rank + 1) * 2 * chunks]
        with counting_collectives() as window, engine.coalesce_grad_reduction() if coalesce else \
                contextlib.nullcontext():
            for xc, yc in zip(xs.split(2), ys.split(2), strict=True):
                out = engine(xc)
                loss = (out - yc).pow(2).sum() if exact else torch.nn.functional.mse_loss(out, yc)
                engine.backward(loss)
        counts.append(window["all_reduce"] + window["reduce"] + window["batch_isend_irecv"])
        engine.step()
    return {"state": {k: v.clone() for k, v in engine.module.state_dict().items()}, "counts": counts,
            "buckets": len(getattr(engine.reducer, "buckets", ()))}


def _coalesce(stage: int, coalesce: bool, steps: int, zero: dict | None = None, exact: bool = False) -> list[dict]:
    return run_distributed(_coalesce_body, world_size=2, args=(stage, coalesce, steps, zero or {}, exact), timeout=60)


def assert_equal_states(a: dict, b: dict) -> None:
    for key, value in b.items():
        assert torch.equal(a[key], value), key


@pytest.mark.parametrize("stage", [1, 2])
def test_coalesce_grad_reduction_is_bit_exact(stage):
    """Exact arithmetic: the coalesced window, stage 2's per-backward reduction and stage 0 agree to the bit."""
    steps = 2
    coalesced = _coalesce(stage, True, steps, exact=True)
    baseline = _coalesce(0, False, steps, exact=True)  # stage 0: one all-reduce per backward
    per_backward = _coalesce(2, False, steps, exact=True)
    for rank in range(2):
        assert_equal_states(coalesced[rank]["state"], baseline[rank]["state"])
        assert_equal_states(per_backward[rank]["state"], baseline[rank]["state"])
    initial = _exact_problem(steps, 12)[0].state_dict()
    assert not torch.equal(coalesced[0]["state"]["weight"], initial["weight"])
    assert coalesced[0]["counts"] == [1] * steps  # one collective per window, against three
    assert per_backward[0]["counts"] == baseline[0]["counts"] == [3] * steps


@pytest.mark.parametrize("zero", [{}, {"reduce_bucket_size": 40, "overlap_comm": True}], ids=["one_bucket", "three"])
@pytest.mark.parametrize("stage", [1, 2])
def test_coalesce_grad_reduction_one_reduction_per_window(stage, zero):
    steps = 5
    coalesced = _coalesce(stage, True, steps, zero)
    buckets = coalesced[0]["buckets"]
    assert buckets == (3 if zero else 1)  # reversed sizes 3, 36, 12, 72 in buckets of <= 40: [3, 36], [12], [72]
    assert [r["counts"] for r in coalesced] == [[buckets] * steps] * 2  # one pass over the buckets per window
    # three chunk-mean losses per rank: three times the global batch's mean loss
    ref = reference_run({"batch": 12, "steps": steps, "loss_factor": 3.0})
    assert rel_error(coalesced[0]["state"], ref["state"]) <= 1e-5
    if stage == 2:  # the per-backward baseline: 3 reductions per window, the same weights up to the sum order
        per_backward = _coalesce(2, False, steps, zero)
        assert per_backward[0]["counts"] == [3 * buckets] * steps
        assert rel_error(coalesced[0]["state"], per_backward[0]["state"]) <= 1e-6


def test_stage1_several_backward_calls_per_step_match_stage0():
    steps = 3
    got = _coalesce(1, False, steps)
    base = _coalesce(0, False, steps)
    assert rel_error(got[0]["state"], base[0]["state"]) <= 1e-5


def _coalesce_misuse_body(stage: int) -> dict:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=make_model(), config=zero_config({"stage": stage}))
    out = {}
    if stage == 0:
        with pytest.raises(NotImplementedError) as info, engine.coalesce_grad_reduction():
            pass
        return {"stage0": str(info.value)}
    with pytest.raises(RuntimeError) as info, engine.coalesce_grad_reduction():
        engine.backward(engine(torch.randn(2, IN)).sum())
        engine.step()
    out["step"] = str(info.value)
    engine.zero_grad()
    if stage == 1:
        with pytest.raises(RuntimeError) as info, engine.no_sync(), engine.coalesce_grad_reduction():
            pass
        out["no_sync"] = str(info.value)
    # after the misuse the engine still trains
    before = engine.module[0].weight.detach().clone()
    engine.backward(engine(torch.randn(2, IN)).sum())
    engine.step()
    out["trained"] = not torch.equal(before, engine.module[0].weight)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_coalesce_grad_reduction_misuse_raises(stage):
    result = run_distributed(_coalesce_misuse_body, world_size=2, args=(stage,), timeout=60)[0]
    if stage == 0:
        assert "stage 0" in result["stage0"]
        return
    assert "step" in result["step"] and result["trained"]
    if stage == 1:
        assert "no_sync" in result["no_sync"]


# ---- options rejected for stages 1 and 2, and the accessors ---------------------------------------------------
REJECTED = {
    "offload_optimizer.device": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
    "offload_optimizer.ratio": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}},
    "offload_param.device": {"offload_param": {"device": "cpu"}},
    "zero_quantized_weights": {"zero_quantized_weights": True},
    "legacy_stage1": {"legacy_stage1": True},
}


def _initialize_error_body(config: dict) -> tuple[str, str]:
    import deepspeed

    with pytest.raises(ValueError) as info:
        deepspeed.initialize(model=make_model(), config=config)
    return type(info.value).__name__, str(info.value)


@pytest.mark.parametrize("key", list(REJECTED))
@pytest.mark.parametrize("stage", [1, 2])
def test_unsupported_options_raise_config_error_naming_the_key(stage, key):
    config = zero_config({"stage": stage, **REJECTED[key]}, optimizer=ADAMW)
    name, message = run_distributed(_initialize_error_body, world_size=1, args=(config,), timeout=60)[0]
    assert name == "ConfigError"
    assert f"zero_optimization.{key}" in message


def _accessors_body() -> list[tuple]:
    import deepspeed

    out = []
    for stage in (0, 1, 2):
        engine, _, _, _ = deepspeed.initialize(model=make_model(), config=zero_config({"stage": stage}))
        out.append((engine.zero_optimization_stage(), engine.zero_optimization_partition_gradients(),
                    engine.zero_optimization(), type(engine.optimizer).__name__))
    return out


def test_engine_zero_accessors():
    got = run_distributed(_accessors_body, world_size=1, timeout=60)[0]
    assert got == [(0, False, False, "FP32Optimizer"), (1, False, True, "DeepSpeedZeroOptimizer"),
                   (2, True, True, "DeepSpeedZeroOptimizer")]
