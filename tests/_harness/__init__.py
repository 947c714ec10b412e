"""Shared harness for multi-rank tests: run a test body in N real processes over torch.distributed (gloo).

Usage (``pytest.ini`` puts ``tests/`` on the path)::

    import os

    import torch
    import torch.distributed as dist
    from _harness import distributed_test, run_distributed

    def _sum_of_ranks(scale):              # runs on every rank; the gloo group is already initialised
        t = torch.tensor([float(dist.get_rank() * scale)])
        dist.all_reduce(t)
        return t.item()                    # return values come back to the test, indexed by rank

    def test_all_reduce():
        assert run_distributed(_sum_of_ranks, world_size=4, args=(2.0,), timeout=30) == [12.0] * 4

    @distributed_test(world_size=[1, 2, 4])   # one test case per size: ids 1ranks, 2ranks, 4ranks
    def test_world(tmp_path):                 # fixtures are resolved in the parent and sent to every rank
        assert dist.get_world_size() == int(os.environ["WORLD_SIZE"])

What each rank gets: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``
and ``MASTER_PORT`` on top of the test process's environment (so ``monkeypatch.setenv`` reaches the ranks),
the test's working directory and ``sys.path``, and a fresh process group on a fresh TCPStore rendezvous.
With ``init_process_group=False`` it gets the environment only and the body calls ``init_process_group``
itself (``env://`` works). Each rank runs with ``torch.set_num_threads(1)`` unless ``OMP_NUM_THREADS`` is
set (as torchrun does). ``backend="nccl"`` is passed through for GPU tests; the body picks its device from
``LOCAL_RANK``. Bodies may be module-level functions, nested functions, closures or lambdas (see
``_pickling``); arguments and return values must be picklable. From a plain script, call the harness under
``if __name__ == "__main__":`` (multiprocessing re-imports the script in the workers). A fixture,
``distributed``, returns :func:`run_distributed` for tests that prefer fixtures to imports.

Failures: a rank that raises, dies (``os._exit``, a signal) or outlives ``timeout`` (default 60 s) makes the
test fail with :class:`DistributedTestFailure` (:class:`DistributedTimeout` for a timeout) whose message
leads with the first failing rank's number and its traceback (with pytest's assertion details), followed by
the other ranks: their tracebacks, exit codes, or a faulthandler stack dump of every rank still running,
taken just before it is killed. After a failure the other ranks get ``FAILURE_GRACE_S`` (1 s) to finish,
then are killed. Each rank's stdout/stderr is printed in the test process, where pytest shows it.

Processes: ranks run in pooled worker processes that already imported torch (forkserver preload), reused
by the next test when every rank passed (start-up: ~1.5-3 s once per session for the forkserver's torch
import, ~0.2 s per new worker, ~15/30/55 ms per test for 1/2/4 warm ranks on a 2-core machine; see
``benchmarks/harness_startup.py``); any worker of a failed, hung or interrupted test is killed and
replaced. Workers die with the test process (parent-death signal plus a watchdog polling its pid), and the
pool is stopped at session end and at interpreter exit. Between tests a worker restores its environment
variables, working directory, torch default dtype, thread count, grad mode, deterministic-algorithms flag
and the torch RNG seed of a fresh process, and the process group is destroyed.
What may leak from one passing test to the next on the same worker: modules it imported (and their
module-level state, including the test module itself, which is imported once per worker), monkey-patches
of library objects, registered hooks, the ``random``/``numpy`` RNG state, and settings read once at import
(e.g. ``OMP_NUM_THREADS``). A test that needs brand-new processes calls ``shutdown_pool()`` first.

Settings (environment): ``DS_TEST_TIMEOUT_SCALE`` multiplies every timeout (slow CI);
``DS_TEST_START_METHOD`` = forkserver (default) | spawn | fork (fastest cold start, but the workers inherit
the test process's state, threads and any process group it initialised: use it only when the parent is
clean); ``DS_TEST_POOL_IDLE`` = how many idle workers stay alive between tests (default 4).
"""

from _harness._decorator import distributed_test
from _harness._pool import get_pool, shutdown_pool
from _harness._runner import (
    DEFAULT_TIMEOUT_S,
    FAILURE_GRACE_S,
    DistributedTestFailure,
    DistributedTimeout,
    RankOutcome,
    run_distributed,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FAILURE_GRACE_S",
    "DistributedTestFailure",
    "DistributedTimeout",
    "RankOutcome",
    "distributed_test",
    "get_pool",
    "run_distributed",
    "shutdown_pool",
]
