"""ZeRO-3 features on gloo ranks: tied weights, external parameters (used outside their module, or returned from
a forward), a model whose forward order changes between steps, ``zero.Init``, ``GatheredParameters``, leaf
modules, evaluation without an optimizer, the engine's ZeRO-3 methods, the ``safe_*`` APIs and bad input.

Each training case runs the same body with ``zero_optimization.stage`` 0 and 3 (every parameter partitioned)
and compares the gathered weights and the losses (fp32: relative error <= 1e-5 over 8 steps).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}}}
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
VOCAB, DIM = 11, 8


class TiedLM(torch.nn.Module):
    """The output projection is the embedding's weight (the same Parameter in two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.hidden = torch.nn.Linear(DIM, DIM)
        self.out = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(ids))))


class ExternalLM(torch.nn.Module):
    """The spec's external-parameter pattern: the embedding's weight is used again in the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.hidden = torch.nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(ids)))
        return torch.nn.functional.linear(h, self.embed.weight)


class BiasReturning(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.nn.functional.linear(x, self.weight), self.bias


class ReturnedLM(torch.nn.Module):
    """The spec's second pattern: a submodule returns its own bias, which its caller adds."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.proj = BiasReturning(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, bias = self.proj(self.embed(ids))
        return self.head(torch.tanh(out + bias))


class DynamicLM(torch.nn.Module):
    """The order of two blocks changes every other forward (the same on every rank, as ZeRO-3 requires): the
    prefetch trace must follow."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.a = torch.nn.Linear(DIM, DIM)
        self.b = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        self.calls += 1
        first, second = (self.a, self.b) if (self.calls // 2) % 2 else (self.b, self.a)
        return self.head(torch.tanh(second(torch.tanh(first(h)))))


class WideLM(torch.nn.Module):
    """Partitions large enough (> 65536 elements per rank) to travel point to point on their own, beside a
    packed batch of small ones."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, 20000)
        self.head = torch.nn.Linear(20000, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.up(self.embed(ids))))


MODELS = {"wide": WideLM, "tied": TiedLM, "external": ExternalLM, "returned": ReturnedLM, "dynamic": DynamicLM}


def _batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(VOCAB, (batch, 4), generator=gen), torch.randint(VOCAB, (batch, 4), generator=gen))
            for _ in range(steps)]


def _whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}


def _train(kind: str, zero: dict, steps: int = 8, gas: int = 2, init: bool = False, extra: dict | None = None) -> dict:
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    config = {**BASE, "gradient_accumulation_steps": gas, "zero_optimization": zero, **(extra or {})}
    if "offload_optimizer" in zero:  # the config's AdamW becomes DeepSpeedCPUAdam
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}}
    torch.manual_seed(rank)  # a different init per rank: the engine (or zero.Init) broadcasts rank 0's
    if init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = MODELS[kind]()
        shapes = {n: (tuple(p.shape), p.ds_tensor.numel()) for n, p in model.named_parameters()}
    else:
        model, shapes = MODELS[kind](), None
    engine, *_ = deepspeed.initialize(model=model, config=config)
    losses = []
    for x, y in _batches(steps, 2 * gas * world):
        for g in range(gas):
            lo = (g * world + rank) * 2
            out = engine(x[lo:lo + 2])
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), y[lo:lo + 2].reshape(-1))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return {"losses": losses, "weights": _whole(engine.module), "shapes": shapes,
            "norm": engine.get_global_grad_norm()}


def _close(a: dict, b: dict, tol: float = 1e-5) -> float:
    worst = 0.0
    for k, v in b.items():
        worst = max(worst, float((a[k] - v).norm() / max(float(v.norm()), 1e-12)))
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize(("kind", "world"), [("tied", 2), ("external", 2), ("returned", 2), ("dynamic", 2),
                                             ("tied", 4), ("wide", 2)])
def test_patterns_match_stage0(kind, world):
    got = run_distributed(_train, world_size=world, args=(kind, Z3), timeout=90)
    base = run_distributed(_train, world_size=world, args=(kind, {"stage": 0}), timeout=90)
    _close(got[0]["weights"], base[0]["weights"])
    assert got[1]["weights"].keys() == base[0]["weights"].keys()
    assert got[0]["losses"] == pytest.approx(base[0]["losses"], rel=1e-5)
    assert got[0]["norm"] == pytest.approx(base[0]["norm"], rel=1e-5)


def _train_counting_trace_warnings(zero: dict) -> dict:
    import logging

    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    try:
        out = _train("dynamic", zero)
    finally:
        logger.removeHandler(handler)
    return {**out, "warnings": sum("prefetch trace was rebuilt" in m for m in warned)}


@pytest.mark.parametrize("log", [True, False])
def test_dynamic_order_with_prefetch_and_trace_warning(log):
    zero = {**Z3, "stage3_prefetch_bucket_size": 100, "stage3_max_reuse_distance": 0, "overlap_comm": True,
            "log_trace_cache_warnings": log}
    got = run_distributed(_train_counting_trace_warnings, world_size=2, args=(zero,), timeout=90)
    base = run_distributed(_train, world_size=2, args=("dynamic", {"stage": 0}), timeout=90)
    _close(got[0]["weights"], base[0]["weights"])
    # the order flips every other forward (16 passes): the trace is rebuilt each time it changed, warned only on request
    assert (got[0]["warnings"] > 0) is log



def test_zero_init_partitions_at_construction_and_trains_like_stage0():
    got = run_distributed(_train, world_size=2, args=("tied", Z3), kwargs={"init": True}, timeout=90)
    base = run_distributed(_train, world_size=2, args=("tied", {"stage": 0}), timeout=90)
    # built partitioned: every parameter's own tensor is empty and each rank holds ceil(numel / 2) elements
    assert got[0]["shapes"] == {"embed.weight": ((0,), 44), "hidden.weight": ((0,), 32), "hidden.bias": ((0,), 4)}
    _close(got[0]["weights"], base[0]["weights"])
    assert got[0]["losses"] == pytest.approx(base[0]["losses"], rel=1e-5)


def test_cpu_offload_with_zero_init_bf16_close_to_stage0():
    extra = {"bf16": {"enabled": True}}
    zero = {**Z3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    got = run_distributed(_train, world_size=2, args=("external", zero), kwargs={"init": True, "extra": extra},
                          timeout=90)
    base = run_distributed(_train, world_size=2, args=("external", {"stage": 0}), kwargs={"extra": extra},
                           timeout=90)
    _close({k: v.float() for k, v in got[0]["weights"].items()},
           {k: v.float() for k, v in base[0]["weights"].items()}, tol=2e-2)


# ---- GatheredParameters, leaf modules, evaluation, engine methods -------------------------------------------------
def _gathered_and_methods(tmp: str) -> dict:
    import deepspeed

    rank = dist.get_rank()
    torch.manual_seed(rank)
    with deepspeed.zero.Init():
        model = TiedLM()
    w = model.hidden.weight
    assert w.numel() == 0 and w.ds_status.name == "NOT_AVAILABLE"
    with deepspeed.zero.GatheredParameters(w, modifier_rank=0):
        assert tuple(w.shape) == (DIM, DIM)
        if rank == 0:
            w.data.fill_(0.25)  # only rank 0 changes it; the exit broadcasts rank 0's value
    assert w.numel() == 0
    with deepspeed.zero.GatheredParameters(w):
        gathered = w.detach().clone()
    deepspeed.utils.set_z3_leaf_modules(model, [torch.nn.Linear])
    leaves = [type(m).__name__ for m in deepspeed.utils.get_z3_leaf_modules(model)]
    config = {**BASE, "zero_optimization": {**Z3, "stage3_gather_16bit_weights_on_model_save": True}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    ids = torch.randint(VOCAB, (2, 4), generator=torch.Generator().manual_seed(5))
    engine.backward(engine(ids).sum())
    local_grad = deepspeed.utils.safe_get_local_grad(model.hidden.weight)
    full_grad = deepspeed.utils.safe_get_full_grad(model.hidden.weight)
    engine.step()
    fp32 = deepspeed.utils.safe_get_full_fp32_param(model.hidden.weight)
    local = deepspeed.utils.safe_get_local_fp32_param(model.hidden.weight)
    exp_avg = deepspeed.utils.safe_get_local_optimizer_state(model.hidden.weight, "exp_avg")
    deepspeed.utils.safe_set_full_fp32_param(model.hidden.bias, torch.full((DIM,), 0.5))
    with deepspeed.zero.GatheredParameters(model.hidden.bias):
        bias = model.hidden.bias.detach().clone()
    sd = engine._zero3_consolidated_16bit_state_dict()
    saved = engine.save_16bit_model(tmp)
    engine.empty_partition_cache()
    statuses = {p.ds_status.name for p in model.parameters()}
    plain = model.state_dict()
    return {"gathered": gathered, "leaves": leaves, "local_grad": local_grad, "full_grad": full_grad,
            "fp32": fp32, "local": local, "exp_avg": exp_avg, "bias": bias, "sd": {k: v.shape for k, v in sd.items()},
            "saved": saved, "statuses": statuses, "plain": {k: tuple(v.shape) for k, v in plain.items()},
            "sd_hidden": sd.get("hidden.weight")}


def test_gathered_parameters_engine_methods_and_safe_apis(tmp_path):
    out = run_distributed(_gathered_and_methods, world_size=2, args=(str(tmp_path),), timeout=90)
    r0, r1 = out
    assert torch.equal(r0["gathered"], torch.full((DIM, DIM), 0.25)) and torch.equal(r1["gathered"], r0["gathered"])
    assert r0["leaves"] == ["Linear", "Linear"]
    # the local slices are this rank's halves of the full values
    assert torch.equal(torch.cat([r0["local_grad"], r1["local_grad"]]), r0["full_grad"].reshape(-1).float())
    assert torch.equal(torch.cat([r0["local"], r1["local"]]), r0["fp32"].reshape(-1))
    assert r0["exp_avg"].shape == (32,)
    assert torch.equal(r0["bias"], torch.full((DIM,), 0.5)) and torch.equal(r1["bias"], r0["bias"])
    # rank 0 gets the consolidated weights (the tied alias included), the others nothing
    assert r0["sd"] == {"embed.weight": (VOCAB, DIM), "hidden.weight": (DIM, DIM), "hidden.bias": (DIM,),
                        "out.weight": (VOCAB, DIM)}
    assert r1["sd"] == {}
    assert r0["saved"] and torch.equal(torch.load(tmp_path / "pytorch_model.bin")["hidden.weight"], r0["sd_hidden"])
    assert r0["statuses"] == {"NOT_AVAILABLE"}
    # a plain state_dict of a ZeRO-3 model holds empty tensors for the partitioned weights (as DeepSpeed's files)
    assert set(r0["plain"].values()) == {(0,)}


def _frozen_local_reads() -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = TiedLM()
    model.hidden.weight.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config={**BASE, "zero_optimization": Z3})
    engine.backward(engine(torch.randint(VOCAB, (2, 4), generator=torch.Generator().manual_seed(5))).sum())
    frozen, trained = model.hidden.weight, model.hidden.bias
    reads = {"fp32": deepspeed.utils.safe_get_local_fp32_param, "grad": deepspeed.utils.safe_get_local_grad}
    out = {name: (read(frozen), read(trained)) for name, read in reads.items()}
    engine.step()
    out["exp_avg"] = (deepspeed.utils.safe_get_local_optimizer_state(frozen, "exp_avg"),
                      deepspeed.utils.safe_get_local_optimizer_state(trained, "exp_avg"))
    try:
        deepspeed.utils.safe_set_local_fp32_param(frozen, torch.zeros(frozen.ds_tensor.numel()))
        out["set"] = "no error"
    except AssertionError as exc:
        out["set"] = str(exc)
    return out


def test_local_reads_of_a_frozen_zero3_parameter_are_none():
    """As DeepSpeed (and the ``safe_get_full_*`` reads): a frozen ZeRO-3 parameter has no fp32 value, gradient
    or optimizer state; writing one is still an error."""
    for out in run_distributed(_frozen_local_reads, world_size=2, timeout=90):
        for name in ("fp32", "grad", "exp_avg"):
            frozen, trained = out[name]
            assert frozen is None and trained is not None and trained.numel() == DIM // 2, name
        assert "no ZeRO stage 3 optimizer" in out["set"]


def _evaluate(zero: dict) -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = ExternalLM()
    ids = torch.randint(VOCAB, (3, 4), generator=torch.Generator().manual_seed(1))
    want = model(ids).detach()
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                           "zero_optimization": zero})
    with torch.no_grad():
        got = engine(ids)
    return {"equal": torch.allclose(got, want, rtol=0, atol=1e-6), "optimizer": engine.optimizer,
            "released": all(p.numel() == 0 for p in model.parameters())}


def test_evaluation_without_optimizer():
    for r in run_distributed(_evaluate, world_size=2, args=(Z3,), timeout=60):
        assert r == {"equal": True, "optimizer": None, "released": True}


# ---- bad input ------------------------------------------------------------------------------------------------------
def _bad(case: str) -> str:
    import deepspeed

    model = TiedLM()
    zero = dict(Z3)
    if case == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": "/tmp/no-such-nvme-mount"}  # ZeRO-Infinity
    if case == "pipeline":
        model = type("PipelineModule", (TiedLM,), {})()  # what deepspeed.pipe's model class is called
    try:
        engine, *_ = deepspeed.initialize(model=model, config={**BASE, "zero_optimization": zero})
        if case == "shape":
            bad = {"hidden.weight": torch.zeros(3, 3)}
            engine.module.load_state_dict(bad, strict=False)
        if case == "data":  # a released parameter's values are never silently the empty tensor
            model.hidden.weight.sum()
        if case == "unregister":
            deepspeed.zero.unregister_external_parameter(model.hidden, model.embed.weight)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(("case", "words"), [
    ("nvme", ["offload_param.nvme_path", "/tmp/no-such-nvme-mount", "does not exist", "create swap folder"]),
    ("shape", ["hidden.weight", "(3, 3)", "(8, 8)"]),
    ("unregister", ["unregister_external_parameter", "Linear"]),
    ("pipeline", ["zero_optimization.stage", "pipeline parallelism", "0 or 1"]),
    ("data", ["hidden.weight", "(8, 8)", "sum()", "deepspeed.zero.GatheredParameters"]),
])
def test_bad_input_is_a_clear_error(case, words):
    message = run_distributed(_bad, world_size=1, args=(case,), timeout=60)[0]
    for word in words:
        assert word in message, message


def _offload_states_round_trip() -> dict:
    import deepspeed
    from deepspeed.runtime.zero.offload_states import get_state_devices
    from ds_config.zero import OffloadStateTypeEnum

    torch.manual_seed(0)
    model = TiedLM()
    engine, *_ = deepspeed.initialize(model=model, config={**BASE, "zero_optimization": Z3})
    ids = torch.randint(VOCAB, (2, 4), generator=torch.Generator().manual_seed(2))
    engine.backward(engine(ids).float().pow(2).mean())
    engine.step()
    engine.offload_states()
    refused = ""
    try:
        engine.backward(engine(ids).float().pow(2).mean())
    except RuntimeError as exc:  # only when a state really left its device (not on a CPU-only run)
        refused = str(exc)
    engine.reload_states()
    engine.backward(engine(ids).float().pow(2).mean())
    engine.step()
    devices = {s.value: sorted(str(d) for d in get_state_devices(engine, s)) for s in OffloadStateTypeEnum}
    return {"refused": refused, "devices": devices, "steps": engine.global_steps}


def test_offload_states_round_trip_at_stage3():
    for r in run_distributed(_offload_states_round_trip, world_size=2, timeout=60):
        assert r["steps"] == 2
        assert r["devices"]["hp_params"] == ["cpu"] and r["devices"]["lp_params"] == ["cpu"]
        assert r["devices"]["optim_states"] == ["cpu"]


def _init_contexts() -> dict:
    import deepspeed

    original_apply = torch.nn.Module.apply
    with deepspeed.zero.Init():
        with deepspeed.zero.Init():
            inner = torch.nn.Linear(4, 4)
        middle = torch.nn.Linear(4, 4)  # still inside the outer context: partitioned
        patched = torch.nn.Module.apply is not original_apply
    try:
        with deepspeed.zero.Init():
            raise KeyError("boom")
    except KeyError:
        pass
    after = torch.nn.Linear(4, 4)
    return {"inner": hasattr(inner.weight, "ds_id"), "middle": hasattr(middle.weight, "ds_id"), "patched": patched,
            "restored": torch.nn.Module.apply is original_apply, "after": hasattr(after.weight, "ds_id")}


def test_zero_init_nests_and_restores_on_exception():
    r = run_distributed(_init_contexts, world_size=2, timeout=60)[0]
    assert r == {"inner": True, "middle": True, "patched": True, "restored": True, "after": False}
