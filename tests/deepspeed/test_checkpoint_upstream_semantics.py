"""Checkpoint behaviours DeepSpeed's own unit tests (``tests/unit/checkpoint``) rely on, each checked here in a
few seconds: the engine's ``sparse_tensor_module_names`` (saved, restored strictly, merged when not strict), the
checkpoint-name methods, ``PipelineEngine.set_dataloader``, and the ZeRO internals under DeepSpeed's names."""

from __future__ import annotations

import os

import torch
from _harness import run_distributed


class _Embedder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 3)
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.emb(x))


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _sparse_names_body(save_dir: str) -> dict:
    import deepspeed

    def engine(model: torch.nn.Module, sparse: bool):
        config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "sparse_gradients": sparse}
        return deepspeed.initialize(model=model, config=config)[0]

    saved = engine(_Embedder(), True)
    out = {"enabled": saved.sparse_gradients_enabled(), "saved": set(saved.sparse_tensor_module_names),
           "dense": set(engine(_Embedder(), False).sparse_tensor_module_names)}
    saved.save_checkpoint(save_dir, tag="t")
    strict = engine(_Embedder(), False)
    strict.load_checkpoint(save_dir, tag="t")
    out["strict"] = set(strict.sparse_tensor_module_names)
    loose = engine(_Embedder(), False)  # non-strict: the saved sparse weight exists here, so it stays sparse
    loose.load_checkpoint(save_dir, tag="t", load_module_strict=False, load_optimizer_states=False)
    out["loose"] = set(loose.sparse_tensor_module_names)
    plain = engine(_Plain(), False)  # non-strict into a model without the embedding: nothing is sparse
    plain.load_checkpoint(save_dir, tag="t", load_module_strict=False, load_optimizer_states=False)
    out["plain"] = set(plain.sparse_tensor_module_names)
    dense = engine(_Embedder(), False)
    dense.save_checkpoint(save_dir, tag="d")
    keeps = engine(_Embedder(), True)  # non-strict: the checkpoint holds emb.weight dense, so it turns dense
    keeps.load_checkpoint(save_dir, tag="d", load_module_strict=False, load_optimizer_states=False)
    out["from_dense"] = set(keeps.sparse_tensor_module_names)
    file = torch.load(f"{save_dir}/t/mp_rank_00_model_states.pt", weights_only=False)
    out["in_file"] = file["sparse_tensor_module_names"]
    return out


def test_sparse_tensor_module_names_saved_and_restored(tmp_path):
    out = run_distributed(_sparse_names_body, world_size=1, args=(str(tmp_path),), timeout=120)[0]
    assert out["enabled"] is True
    assert out["saved"] == {"emb.weight"} and out["dense"] == set()
    assert out["in_file"] == {"emb.weight"}
    assert out["strict"] == {"emb.weight"}
    assert out["loose"] == {"emb.weight"}
    assert out["plain"] == set()
    assert out["from_dense"] == set()


class _MoENet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=1, k=1, min_capacity=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0].sum()


def _optimizer_name_body(save_dir: str) -> dict:
    """The MoE optimizer file is named through ``engine._get_optimizer_ckpt_name`` (DeepSpeed's tests patch it to
    prove that ``load_optimizer_states=False`` never reaches for the file)."""
    from unittest.mock import patch

    import deepspeed

    config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    saved = deepspeed.initialize(model=_MoENet(), config=config)[0]
    saved.backward(saved(torch.randn(3, 4)))
    saved.step()
    saved.save_checkpoint(save_dir, tag="t")
    out = {"name": saved._get_optimizer_ckpt_name(save_dir, "t", 0),
           "ckpt_name": saved._get_ckpt_name(save_dir, "t"),
           "all": saved._get_all_ckpt_names(save_dir, "t"),
           "expert": saved._get_expert_ckpt_name(save_dir, 0, 1, "t")}
    for load_optimizer in (False, True):
        loaded = deepspeed.initialize(model=_MoENet(), config=config)[0]
        with patch.object(loaded, "_get_optimizer_ckpt_name", wraps=loaded._get_optimizer_ckpt_name) as spy:
            loaded.load_checkpoint(save_dir, tag="t", load_optimizer_states=load_optimizer)
        out[f"calls_{load_optimizer}"] = [call.args for call in spy.call_args_list]
    return out


def test_moe_optimizer_file_named_by_the_engine_method(tmp_path):
    out = run_distributed(_optimizer_name_body, world_size=1, args=(str(tmp_path),), timeout=120)[0]
    tag_dir = tmp_path / "t"
    assert out["name"] == str(tag_dir / "expp_rank_0_mp_rank_00_optim_states.pt")
    assert (tag_dir / "expp_rank_0_mp_rank_00_optim_states.pt").is_file()
    assert out["ckpt_name"] == str(tag_dir / "mp_rank_00_model_states.pt")
    assert out["all"] == [out["ckpt_name"]]
    assert out["expert"] == str(tag_dir / "layer_0_expert_1_mp_rank_00_model_states.pt")
    assert (tag_dir / "layer_0_expert_1_mp_rank_00_model_states.pt").is_file()
    assert out["calls_False"] == []
    assert out["calls_True"] == [(str(tmp_path), "t", 0)]


def _set_dataloader_body() -> list:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    data = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(4)]
    losses = []
    for use_loader in (True, False):
        torch.manual_seed(1)
        module = PipelineModule([torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)], num_stages=2,
                                loss_fn=torch.nn.MSELoss())
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine = deepspeed.initialize(model=module, config=config)[0]
        if use_loader:
            engine.set_dataloader(data)
            losses.append([float(engine.train_batch()) for _ in range(2)])
        else:
            it = iter(data)
            losses.append([float(engine.train_batch(it)) for _ in range(2)])
    return losses


def test_pipeline_set_dataloader_feeds_train_batch():
    for from_loader, from_iterator in run_distributed(_set_dataloader_body, world_size=2, timeout=120):
        assert from_loader == from_iterator


def _zero_names_body(save_dir: str) -> dict:
    """DeepSpeed's attribute and method names on the ZeRO optimizers and the engine that its checkpoint tests and
    universal-checkpoint tools read."""
    import deepspeed

    out = {}
    for stage in (0, 1, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                  "zero_optimization": {"stage": stage, "sub_group_size": 10}}
        engine = deepspeed.initialize(model=model, config=config)[0]
        engine.backward(engine(torch.randn(1, 4)).sum())
        engine.step()
        opt = engine.optimizer
        if stage == 0:
            out[0] = {"is_torch_optimizer": isinstance(opt, torch.optim.Optimizer)}
            continue
        shapes = engine._get_zero_param_shapes()
        row = {"shapes": [{k: tuple(v) for k, v in group.items()} for group in shapes]}
        if stage == 1:
            row["fp32"] = [t.numel() for t in opt.single_partition_of_fp32_groups]
        else:
            before = opt.optimizer.state_dict()
            opt._set_fp32_optimizer_param_groups()
            sd = opt.optimizer.state_dict()
            opt._clear_fp32_optimizer_param_groups()
            row["fp32"] = [t.numel() for t in opt.fp32_partitioned_groups_flat]
            row["state_numels"] = [sd["state"][i]["exp_avg"].numel() for i in sorted(sd["state"])]
            row["same_state"] = sorted(before["state"]) == sorted(sd["state"])
            engine.backward(engine(torch.randn(1, 4)).sum())  # training goes on after the set/clear pair
            engine.step()
            row["steps"] = engine.global_steps
        engine.save_checkpoint(save_dir, tag=f"s{stage}")
        row["script_mode"] = os.stat(os.path.join(save_dir, "zero_to_fp32.py")).st_mode
        out[stage] = row
    return out


def test_zero_internals_under_deepspeed_names(tmp_path):
    import stat

    out = run_distributed(_zero_names_body, world_size=1, args=(str(tmp_path),), timeout=180)[0]
    assert out[0]["is_torch_optimizer"] is True  # fp32 ZeRO-0: DeepSpeed hands back the torch optimizer itself
    assert out[1]["shapes"] == [{"0.weight": (3, 4), "0.bias": (3,), "1.weight": (2, 3), "1.bias": (2,)}]
    assert out[1]["fp32"] == [24]  # the 23 elements, padded to the partition alignment (2) as DeepSpeed does
    # sub_group_size 10: a sub-group closes once it reaches 10 elements (DeepSpeed's rule); one flat master and
    # Adam state each
    assert out[3]["shapes"] == [{"0.weight": (3, 4)}, {"0.bias": (3,), "1.weight": (2, 3), "1.bias": (2,)}]
    assert out[3]["fp32"] == out[3]["state_numels"] == [12, 11]
    assert out[3]["same_state"] and out[3]["steps"] == 2
    assert out[1]["script_mode"] & stat.S_IEXEC and out[3]["script_mode"] & stat.S_IEXEC


def test_recovery_script_permission_failure_is_logged(monkeypatch):
    from deepspeed.runtime.engine import DeepSpeedEngine

    logged = []
    monkeypatch.setattr("deepspeed.utils.logger.info", lambda message, *a, **k: logged.append(message))
    DeepSpeedEngine._change_recovery_script_permissions(None, os.path.join("no-such-dir", "zero_to_fp32.py"))
    assert logged and "Could not change permissions" in logged[0]


def test_zero3_elastic_checkpoint_is_deprecated_on_deepspeeds_logger(monkeypatch):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    said = []
    monkeypatch.setattr("deepspeed.utils.logger.warning", lambda message, *a, **k: said.append(message))
    DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
    assert said == []
    DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert len(said) == 1 and "elastic checkpointing is deprecated" in said[0].lower()


def _zero3_universal_body(save_dir: str) -> dict:
    """ZeRO-3 with parameters small enough to stay whole on every rank (persistent): a universal checkpoint loads
    into them too, not only into the partitions."""
    from types import SimpleNamespace

    import torch.distributed as dist

    import deepspeed
    from deepspeed.checkpoint.ds_to_universal import main as convert

    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
              "zero_optimization": {"stage": 3}}

    def engine(extra: dict):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
        return deepspeed.initialize(model=model, config={**config, **extra}, model_parameters=model.parameters())[0]

    trained = engine({})
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        trained.backward(trained(torch.randn(2, 6, generator=gen)).sum())
        trained.step()
    trained.save_checkpoint(save_dir, tag="t", client_state={"universal_checkpoint_info": {}})
    dist.barrier()
    if dist.get_rank() == 0:
        convert(SimpleNamespace(input_folder=f"{save_dir}/t", output_folder=f"{save_dir}/t_universal",
                                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                inject_missing_state=False))
    dist.barrier()
    loaded = engine({"checkpoint": {"load_universal": True}})
    loaded.load_checkpoint(save_dir, tag="t_universal")
    before, after = trained.state_dict(), loaded.state_dict()
    return {"persistent": all(getattr(p, "ds_persist", False) for p in loaded.module.parameters()),
            "equal": {k: bool(torch.equal(before[k], after[k])) for k in before}}


def test_zero3_universal_load_refreshes_persistent_parameters(tmp_path):
    for out in run_distributed(_zero3_universal_body, world_size=2, args=(str(tmp_path),), timeout=240):
        assert out["persistent"]
        assert out["equal"] == {k: True for k in out["equal"]} and len(out["equal"]) == 4
