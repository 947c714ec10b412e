"""Passing multi-rank tests: results, environment, body kinds, the decorator, and pool reuse without leaks."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from _harness import distributed_test, get_pool, run_distributed


def _all_reduce_rank_sum(scale: float) -> float:
    t = torch.tensor([float(dist.get_rank()) * scale])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_result_on_every_rank(world_size):
    expected = 3.0 * sum(range(world_size))
    assert run_distributed(_all_reduce_rank_sum, world_size, args=(3.0,), timeout=30) == [expected] * world_size


def _launcher_env() -> dict:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_PARENT_VAR")
    env = {k: os.environ.get(k) for k in keys}
    env["dist_rank"], env["dist_world"] = dist.get_rank(), dist.get_world_size()
    env["backend"] = dist.get_backend()
    env["cwd"] = os.getcwd()
    return env


def test_ranks_get_launcher_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DS_PARENT_VAR", "from-parent")
    monkeypatch.chdir(tmp_path)
    envs = run_distributed(_launcher_env, 2, timeout=30)
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank) == str(env["dist_rank"])
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2" and env["dist_world"] == 2
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["backend"] == "gloo"
        assert env["DS_PARENT_VAR"] == "from-parent" and env["cwd"] == str(tmp_path)
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and int(envs[0]["MASTER_PORT"]) > 0


def _init_from_env(value: float) -> float:
    assert not dist.is_initialized()
    dist.init_process_group("gloo")  # env:// rendezvous from the variables the harness set
    t = torch.tensor([value])
    dist.all_reduce(t)
    return t.item()


def test_body_can_initialise_the_group_itself():
    assert run_distributed(_init_from_env, 2, args=(1.5,), init_process_group=False, timeout=30) == [3.0, 3.0]


@dataclass
class Box:
    rank: int
    payload: list


def _box_round_trip(box: Box, *, offset: int) -> Box:
    return Box(dist.get_rank() + offset, box.payload + [dist.get_rank()])


def test_arguments_and_return_values_of_test_module_classes():
    boxes = run_distributed(_box_round_trip, 2, args=(Box(-1, ["x"]),), kwargs={"offset": 10}, timeout=30)
    assert boxes == [Box(10, ["x", 0]), Box(11, ["x", 1])]


def test_nested_functions_closures_and_lambdas():
    base = 100

    def fact(n: int) -> int:  # refers to itself through its closure
        return 1 if n <= 1 else n * fact(n - 1)

    def nested(k: int) -> int:
        return base + fact(k) + dist.get_rank()

    assert run_distributed(nested, 2, args=(4,), timeout=30) == [124, 125]
    assert run_distributed(lambda: dist.get_world_size() * base, 2, timeout=30) == [200, 200]


def _pid() -> int:
    return os.getpid()


def test_passing_tests_reuse_the_same_workers():
    pool = get_pool()
    first = run_distributed(_pid, 2, timeout=30)
    started = pool.started
    second = run_distributed(_pid, 2, timeout=30)
    assert second == first and pool.started == started
    assert len(set(first)) == 2 and os.getpid() not in first


def _dirty_state() -> list:
    os.environ["DS_LEAK_CHECK"] = "leaked"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.chdir("/")
    return torch.rand(3).tolist()


def _observe_state() -> tuple:
    return (
        os.environ.get("DS_LEAK_CHECK"), torch.get_default_dtype(), torch.is_grad_enabled(), os.getcwd(),
        torch.rand(3, dtype=torch.float64).tolist(), dist.is_initialized(),
    )


def test_no_state_leaks_into_the_next_test(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    draws = run_distributed(_dirty_state, 2, timeout=30)
    seen = run_distributed(_observe_state, 2, timeout=30)
    for rank in range(2):
        env, dtype, grad, cwd, rand, initialised = seen[rank]
        assert (env, dtype, grad, cwd, initialised) == (None, torch.float32, True, str(tmp_path), True)
        assert rand == draws[rank]  # both tests start from a fresh process's RNG state


@distributed_test(world_size=[1, 2, 4], timeout=30)
def test_decorator_runs_on_every_world_size(tmp_path):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [dist.get_world_size()] * 2
    (tmp_path / f"rank{dist.get_rank()}").write_text(os.environ["WORLD_SIZE"])


@pytest.mark.parametrize("scale", [2, 3])
@distributed_test(world_size=2, timeout=30)
def test_decorator_combines_with_parametrize(scale):
    t = torch.tensor([float(scale)])
    dist.all_reduce(t)
    assert t.item() == 2 * scale


def _nccl_all_reduce() -> float:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    return t.item()


@pytest.mark.gpu
def test_nccl_backend_on_every_gpu():
    n = torch.cuda.device_count()
    assert run_distributed(_nccl_all_reduce, n, backend="nccl", timeout=60) == [float(n)] * n


class TestDecoratedMethods:
    factor = 3

    @distributed_test(world_size=2, timeout=30)
    def test_method_body_gets_its_instance(self, tmp_path):
        t = torch.tensor([float(self.factor)])
        dist.all_reduce(t)
        assert t.item() == 2 * self.factor


def test_timeout_scale_must_be_positive(monkeypatch):
    monkeypatch.setenv("DS_TEST_TIMEOUT_SCALE", "fast")
    with pytest.raises(ValueError, match="DS_TEST_TIMEOUT_SCALE='fast' must be a positive number"):
        run_distributed(_pid, 1)


def test_fixture_exposes_run_distributed(distributed):
    assert distributed is run_distributed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size=0 must be an int >= 1"),
        ({"world_size": 2.0}, "world_size=2.0"),
        ({"timeout": -1}, "timeout=-1 must be a positive number"),
        ({"kwargs": [1]}, r"kwargs=\[1\] must be a dict"),
    ],
    ids=["zero-ranks", "float-ranks", "negative-timeout", "kwargs-list"],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        run_distributed(_pid, **kwargs)


def test_unpicklable_argument_is_reported_before_starting():
    started = get_pool().started
    with pytest.raises(TypeError, match="cannot send"):
        run_distributed(_pid, 2, args=(threading.Lock(),))
    assert get_pool().started == started


def test_class_defined_in_a_test_is_rejected_with_advice():
    class Local:
        pass

    with pytest.raises(TypeError, match="define it at module level"):
        run_distributed(_pid, 1, args=(Local(),))


def test_decorator_rejects_bad_world_size():
    with pytest.raises(ValueError, match=r"world_size=\[2, 0\]"):
        distributed_test(world_size=[2, 0])
