"""The seams between ``deepspeed.initialize`` and its parts, used the way clients use them: the comms logger
configured from the config, ``dist_init_required``, ``lr_scheduler`` as an instance or a callable,
``collate_fn`` and ``deepspeed_io``, Accelerate's boundary-driven loop, the attributes Transformers and
Accelerate read, and ``save_16bit_model`` through the engine."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

IN = 4
BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _one_step(engine, x: torch.Tensor | None = None) -> None:
    engine.backward(engine(torch.randn(2, IN) if x is None else x).pow(2).mean())
    engine.step()


# -- comms_logger: initialize() configures deepspeed.comm from the config ----------------------------------
def _comms_body() -> dict:
    import deepspeed
    from deepspeed import comm
    from ds_config import CommsLoggerConfig

    comm.comms_logger.reset()
    try:
        config = {**BASE, "comms_logger": {"enabled": True, "prof_all": True}}
        engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
        _one_step(engine)
        logged = {op: sum(r.count for r in sizes.values()) for op, sizes in comm.comms_logger.comms_dict.items()}
        table = comm.log_summary()
        engine, _, _, _ = deepspeed.initialize(model=_model(), config=BASE)  # no section: logging off again
        comm.comms_logger.reset()
        _one_step(engine)
        after = dict(comm.comms_logger.comms_dict)
    finally:
        comm.configure(CommsLoggerConfig())
        comm.comms_logger.reset()
    return {"logged": logged, "table": table, "after": after}


def test_initialize_applies_the_comms_logger_section():
    for r in run_distributed(_comms_body, world_size=2, timeout=60):
        assert r["logged"].get("all_reduce", 0) >= 1, r["logged"]  # the engine's gradient all-reduce
        assert "all_reduce" in r["table"]
        assert r["after"] == {}


# -- dist_init_required ---------------------------------------------------------------------------------------
def _no_dist_body() -> dict:
    import deepspeed

    try:
        deepspeed.initialize(model=_model(), config=BASE, dist_init_required=False)
    except RuntimeError as exc:
        return {"initialized": dist.is_initialized(), "error": str(exc)}
    return {"initialized": dist.is_initialized(), "error": None}


def _existing_group_body() -> dict:
    import deepspeed

    world = dist.group.WORLD
    engine, _, _, _ = deepspeed.initialize(model=_model(seed=dist.get_rank()), config=BASE, dist_init_required=True)
    return {"same_group": dist.group.WORLD is world, "dp": engine.dp_world_size,
            "weight": engine.module[0].weight.detach().clone()}


def test_dist_init_required():
    # False and no group: the caller said it owns a group that does not exist; an error, as DeepSpeed asserts
    r = run_distributed(_no_dist_body, world_size=1, init_process_group=False, timeout=60)[0]
    assert r["initialized"] is False and "dist_init_required=False" in r["error"]
    # an existing group is kept, and ranks that initialised differently get rank 0's weights
    out = run_distributed(_existing_group_body, world_size=2, timeout=60)
    assert all(r["same_group"] and r["dp"] == 2 for r in out)
    assert torch.equal(out[0]["weight"], out[1]["weight"])


# -- lr_scheduler: an instance, or a callable taking the optimizer ---------------------------------------------
def _scheduler_body() -> dict:
    import deepspeed

    config = {**BASE, "gradient_accumulation_steps": 2}
    seen = []

    def make(optimizer):
        seen.append(optimizer)
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    engine, optimizer, _, sched = deepspeed.initialize(model=_model(), config=config, lr_scheduler=make)
    lrs = []
    for _ in range(4):
        _one_step(engine)
        lrs.append(engine.get_lr()[0])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    given = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    engine2, _, _, sched2 = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=given, config={
        k: v for k, v in BASE.items() if k != "optimizer"})
    _one_step(engine2)
    return {"called_with_torch_optimizer": seen == [optimizer.optimizer], "sched_is_engine's": sched is
            engine.lr_scheduler, "lrs": lrs, "instance_kept": sched2 is given and engine2.lr_scheduler is given,
            "lr2": engine2.get_lr()[0]}


def test_lr_scheduler_instance_or_callable():
    r = run_distributed(_scheduler_body, world_size=1, timeout=60)[0]
    assert r["called_with_torch_optimizer"] and r["sched_is_engine's"] and r["instance_kept"]
    assert r["lrs"] == [0.1, 0.05, 0.05, 0.025]  # stepped at the accumulation boundaries only
    assert abs(r["lr2"] - 0.02) < 1e-12


# -- training_data + collate_fn -> DeepSpeedDataLoader; deepspeed_io ------------------------------------------
def _collate(samples):
    xs = torch.stack([s[0] for s in samples])
    return xs * 10, torch.tensor([len(samples)])


def _collate_body() -> dict:
    import deepspeed
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    data = torch.utils.data.TensorDataset(torch.arange(16.0).reshape(16, 1).repeat(1, IN))
    engine, _, loader, _ = deepspeed.initialize(model=_model(), config=BASE, training_data=data,
                                                collate_fn=_collate)
    batches = [b for b in loader]
    for x, _ in batches[:2]:
        _one_step(engine, x)
    other = engine.deepspeed_io(data, batch_size=4, collate_fn=_collate)
    return {"type": isinstance(loader, DeepSpeedDataLoader) and loader is engine.training_dataloader,
            "len": len(loader), "rows": sorted(int(v) for x, _ in batches for v in x[:, 0] // 10),
            "sizes": [int(n) for _, n in batches], "scaled": all(float(x[0, 0]) % 10 == 0 for x, _ in batches),
            "io": [int(n) for _, n in other]}


def test_training_data_with_collate_fn_and_deepspeed_io():
    out = run_distributed(_collate_body, world_size=2, timeout=60)
    for r in out:
        assert r["type"] and r["len"] == 4 and r["sizes"] == [2, 2, 2, 2] and r["scaled"]
        assert r["io"] == [4, 4]  # 8 samples per rank in batches of 4
    assert sorted(out[0]["rows"] + out[1]["rows"]) == list(range(16))  # each sample on exactly one rank


# -- Accelerate's loop: boundary set by the client, step() only at the boundary ------------------------------
def _accelerate_body() -> dict:
    import deepspeed

    rank, gas = dist.get_rank(), 2
    config = {**BASE, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0}
    gen = torch.Generator().manual_seed(3)
    micro = [torch.randn(4, IN, generator=gen)[2 * rank:2 * rank + 2] for _ in range(4)]
    plain, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    for x in micro:
        _one_step(plain, x)
    client, optimizer, _, _ = deepspeed.initialize(model=_model(), config=config)
    norms = []
    for i, x in enumerate(micro):  # Accelerate's DeepSpeedEngineWrapper.backward, Transformers' loss / GAS
        sync = (i + 1) % gas == 0
        client.set_gradient_accumulation_boundary(is_boundary=sync)
        client.backward(client(x).pow(2).mean() / gas, scale_wrt_gas=False)
        if sync:
            client.step()
            norms.append(client.get_global_grad_norm())
    same = all(torch.equal(a, b) for a, b in zip(plain.module.state_dict().values(),
                                                  client.module.state_dict().values(), strict=True))
    return {"same": same, "steps": (plain.global_steps, client.global_steps), "norms": norms,
            "skipped": optimizer.overflow, "attrs": [client.global_rank, client.local_rank, client.world_size,
                                                      str(client.device), client.dp_world_size],
            "accessors": [client.zero_optimization_stage(), client.gradient_accumulation_steps(),
                          client.train_micro_batch_size_per_gpu(), client.train_batch_size(),
                          client.bfloat16_enabled(), client.zero_gather_16bit_weights_on_model_save()]}


def test_accelerate_style_boundary_loop_matches_the_plain_loop():
    for rank, r in enumerate(run_distributed(_accelerate_body, world_size=2, timeout=60)):
        assert r["same"] and r["steps"] == (2, 2) and r["skipped"] is False
        assert len(r["norms"]) == 2 and all(isinstance(n, float) and n > 0 for n in r["norms"])
        assert r["attrs"] == [rank, rank, 2, "cpu", 2]
        assert r["accessors"] == [0, 2, 2, 8, False, False]


# -- save_16bit_model through the engine --------------------------------------------------------------------
def _sixteen_bit_body(out_dir: str) -> dict:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=_model(), config={**BASE, "bf16": {"enabled": True}})
    _one_step(engine, torch.randn(2, IN).bfloat16())
    engine.save_16bit_model(out_dir, "weights.bin")
    saved = torch.load(os.path.join(out_dir, "weights.bin"), weights_only=True)
    expected = engine.module.state_dict()
    return {"keys": saved.keys() == expected.keys(),
            "equal": all(saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], expected[k]) for k in saved)}


def test_save_16bit_model_through_the_engine(tmp_path):
    assert run_distributed(_sixteen_bit_body, world_size=1, args=(str(tmp_path),), timeout=60)[0] == {
        "keys": True, "equal": True}


# -- save_checkpoint is collective: rank 0 alone is reported, not hung ----------------------------------------
def _rank_zero_save_body(save_dir: str) -> str | None:
    from torch.distributed import distributed_c10d

    import deepspeed
    from deepspeed.runtime.checkpointing import CheckpointSyncError

    os.environ["DS_CHECKPOINT_TIMEOUT"] = "1.5"
    store, outcome = distributed_c10d._get_default_store(), None
    try:
        engine, _, _, _ = deepspeed.initialize(model=_model(), config=BASE)
        _one_step(engine)
        if dist.get_rank() == 0:
            try:
                engine.save_checkpoint(save_dir)
            except CheckpointSyncError as exc:
                outcome = str(exc)
            store.set("seams/rank0_done", "1")
        else:
            store.wait(["seams/rank0_done"])
        engine.save_checkpoint(save_dir, tag="together")  # a save every rank makes still meets
    finally:
        del os.environ["DS_CHECKPOINT_TIMEOUT"]
    return outcome


def test_engine_save_on_rank_zero_only_is_detected(tmp_path):
    from deepspeed.runtime.checkpointing import read_latest

    out = run_distributed(_rank_zero_save_body, world_size=2, args=(str(tmp_path),), timeout=60)
    assert "ranks [1] did not call save_checkpoint" in out[0] and out[1] is None
    assert not (tmp_path / "global_step1").exists() and read_latest(tmp_path) == "together"


# -- no optimizer at all: an evaluation engine (Transformers/Accelerate evaluation path) ---------------------
def _no_optimizer_body(save_dir: str, stage: int) -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    engine, optimizer, _, sched = deepspeed.initialize(model=_model(), config=config)
    x = torch.randn(2, IN).bfloat16()
    with torch.no_grad():
        same = torch.equal(engine(x), engine.module(x))
    errors = []
    for call in (lambda: engine.backward(engine(x).float().sum()), engine.step):
        try:
            call()
        except RuntimeError as exc:
            errors.append(str(exc))
    engine.save_checkpoint(save_dir)
    other, _, _, _ = deepspeed.initialize(model=_model(seed=1), config=config)
    path, _ = other.load_checkpoint(save_dir)
    loaded = all(torch.equal(a, b) for a, b in zip(engine.module.state_dict().values(),
                                                  other.module.state_dict().values(), strict=True))
    try:
        deepspeed.initialize(model=_model(), config=config, lr_scheduler=lambda opt: None)
        sched_error = "no error"
    except ValueError as exc:
        sched_error = str(exc)
    return {"none": (optimizer, sched, engine.get_lr(), engine.get_global_grad_norm()), "same": same,
            "errors": errors, "loaded": path is not None and loaded, "sched_error": sched_error}


@pytest.mark.parametrize("stage", [0, 2])
def test_engine_without_an_optimizer_evaluates(tmp_path, stage):
    r = run_distributed(_no_optimizer_body, world_size=1, args=(str(tmp_path), stage), timeout=60)[0]
    assert r["none"] == (None, None, [], None) and r["same"] and r["loaded"]
    assert len(r["errors"]) == 2 and all("without an optimizer" in e for e in r["errors"])
    assert "engine.backward" in r["errors"][0] and "engine.step" in r["errors"][1]
    assert "no optimizer" in r["sched_error"]


# -- mesh_param: the pure data-parallel mesh is served, a shape that does not fit the world is a clear error ----
def _mesh_body() -> dict:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=_model(), config=BASE, mesh_param=(2, 1))
    try:
        deepspeed.initialize(model=_model(), config=BASE, mesh_param=(2, 2))
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    return {"dp": engine.dp_world_size, "error": error}


def test_mesh_param():
    for r in run_distributed(_mesh_body, world_size=2, timeout=60):
        assert r["dp"] == 2 and "mesh_param=(2, 2)" in r["error"] and "world size (2)" in r["error"]


# -- a client optimizer whose groups have no learning rate -----------------------------------------------------
class _NoRateSGD(torch.optim.Optimizer):
    def __init__(self, params) -> None:  # noqa: ANN001
        super().__init__(params, defaults={})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1)


def _no_rate_body() -> list:
    import deepspeed

    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_NoRateSGD(model.parameters()),
                                           config={**BASE, "steps_per_print": 1})
    _one_step(engine)
    return engine.get_lr()


def test_get_lr_of_groups_without_a_rate_is_zero():
    assert run_distributed(_no_rate_body, world_size=1, timeout=60)[0] == [0.0]  # as DeepSpeed reports it
