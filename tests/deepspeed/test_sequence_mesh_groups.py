"""DeepSpeed's names for the engine's sequence/data groups, ``mesh_param=(dp, sp)``, and the checkpoint file names
under a sequence-parallel mpu.

- ``config: {"data_parallel_size": dp, "sequence_parallel_size": sp}`` and ``mesh_param=(dp, sp)`` build the same
  groups: blocks of ``sp`` consecutive ranks share a sequence (``engine.seq_parallel_group``), ranks ``sp`` apart
  are data-parallel (``engine.data_parallel_group``), the world is the sequence-data group. Gradients are summed
  over the sequence ranks and averaged over the data-parallel ones (a bias-free ``Linear(1, 1)`` fed ``x = rank +
  1`` has gradient ``x`` on each rank, so the reduced gradient is ``(1 + 2 + 3 + 4) / dp = 5``). ZeRO-3 files are
  named by the rank in the sequence-data group, which ZeRO-3 partitions over.
- The sequence-parallel mpu module (``parallel_state_sp``) names its sequence axis "model parallel", but the
  weights are replicated over it: the engine has no model parallelism (``mp_world_size == 1``,
  ``checkpoint_mp_rank == 0``) and its files are the ``mp_rank_00`` set, so a checkpoint written without sequence
  parallelism loads into it and the other way round.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from _harness import run_distributed

BASE = {"train_batch_size": 8, "steps_per_print": 10**6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _engine(**kwargs):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), **kwargs)
    return engine


def _groups_and_gradient(engine) -> dict:
    x = torch.tensor([[float(dist.get_rank() + 1)]])
    engine.backward(engine(x).sum())
    grad = engine.module.weight.grad.item()
    # DeepSpeed's regression case for sequence-parallel loss averaging: an all-reduce over the sequence group
    loss = torch.tensor(float(dist.get_rank() + 1), requires_grad=True)
    weighted = loss * 1.0
    dist.all_reduce(weighted, group=engine.seq_parallel_group)
    with warnings.catch_warnings():  # torch: the all-reduce has no autograd kernel (a pass-through, as intended)
        warnings.simplefilter("ignore", UserWarning)
        (weighted / 2.0).backward()
    return {"sp": _ranks(engine.seq_parallel_group), "dp": _ranks(engine.data_parallel_group),
            "seq_dp": _ranks(engine.seq_data_parallel_group), "sizes": (engine.dp_world_size,
                                                                        engine.sequence_parallel_size),
            "grad": grad, "loss_grad": loss.grad.item()}


def _mesh_routes() -> dict:
    from deepspeed.utils import groups

    try:
        by_config = _groups_and_gradient(_engine(config_params={**BASE, "data_parallel_size": 2,
                                                                "sequence_parallel_size": 2}))
        by_mesh = _groups_and_gradient(_engine(config=BASE, mesh_param=(2, 2)))
        zero3 = _engine(config={**BASE, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True},
                        mesh_param=(2, 2))
        zero3_name = os.path.basename(zero3._get_ckpt_name("ckpt", "t"))
        errors = []
        for mesh, extra in (((2, 2), {"sequence_parallel_size": 4}), ((4, 1), {"data_parallel_size": 2}),
                            ((3, 1), {}), ((2, 2, 1), {})):
            try:
                _engine(config={**BASE, **extra}, mesh_param=mesh)
                errors.append("no error")
            except ValueError as exc:
                errors.append(str(exc))
        return {"config": by_config, "mesh": by_mesh, "errors": errors, "zero3_name": zero3_name}
    finally:
        groups.register_mpu(None)  # the worker process is reused by later tests


def test_config_and_mesh_param_build_the_same_sequence_and_data_groups():
    for rank, r in enumerate(run_distributed(_mesh_routes, world_size=4, timeout=120)):
        block = rank // 2 * 2
        expected = {"sp": [block, block + 1], "dp": [rank % 2, rank % 2 + 2], "seq_dp": [0, 1, 2, 3],
                    "sizes": (2, 2), "grad": 5.0, "loss_grad": 0.5}
        assert r["config"] == expected and r["mesh"] == expected
        # ZeRO-3 partitions over the sequence-data group: files named by the rank in it (sequence ranks differ)
        assert r["zero3_name"] == f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        wrong_sp, wrong_dp, wrong_world, wrong_shape = r["errors"]
        assert "sequence_parallel_size" in wrong_sp and "mesh_param=(2, 2)" in wrong_sp
        assert "data_parallel_size" in wrong_dp and "mesh_param=(4, 1)" in wrong_dp
        assert "world size (4)" in wrong_world and "mesh_param=(3, 1)" in wrong_world
        assert "mesh_param=(2, 2, 1)" in wrong_shape


def _sequence_mpu_checkpoints(save_dir: str) -> dict:
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp_mpu
    from deepspeed.utils import groups

    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}}
    try:
        plain = _engine(config=config)
        with torch.no_grad():
            plain.module.weight.fill_(1.5)
        plain.save_checkpoint(save_dir, tag="plain")
        sp_mpu.initialize_sequence_parallel(2)
        engine = _engine(config=config, mpu=sp_mpu)
        engine.load_checkpoint(save_dir, tag="plain", load_module_only=True)
        loaded = engine.module.weight.item()
        engine.save_checkpoint(save_dir, tag="sp")
        dist.barrier()
        resumed = _engine(config=config, mpu=sp_mpu)
        resumed.load_checkpoint(save_dir, tag="sp")
        return {"mp": (engine.mp_world_size, engine.checkpoint_mp_rank), "loaded": loaded,
                "resumed": resumed.module.weight.item(), "files": sorted(os.listdir(os.path.join(save_dir, "sp"))),
                "name": os.path.basename(engine._get_ckpt_name(save_dir, "sp"))}
    finally:
        sp_mpu._SEQUENCE_PARALLEL_GROUP = sp_mpu._SEQUENCE_DATA_PARALLEL_GROUP = None
        groups.register_mpu(None)


def test_sequence_parallel_mpu_has_no_model_parallel_rank_in_file_names(tmp_path):
    for r in run_distributed(_sequence_mpu_checkpoints, world_size=2, args=(str(tmp_path),), timeout=120):
        assert r["mp"] == (1, 0) and r["loaded"] == 1.5 and r["resumed"] == 1.5
        assert r["name"] == "mp_rank_00_model_states.pt"
        assert r["files"] == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                              "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
