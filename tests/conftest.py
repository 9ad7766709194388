import os
import sys

# The suite starts hundreds of Python processes (xdist workers, torchrun ranks, CLI runs): with bytecode
# caching switched off in the environment (PYTHONDONTWRITEBYTECODE) each recompiled the library, and each
# worker re-rewrote every test module (~27 s of collection per worker, ~8 s with the caches). Caches on for
# this process and every process it starts; they land in the tree's __pycache__ (git-ignored).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (pyproject's addopts: two workers on a 2-core machine) each worker computes on
    # one intra-op thread: two workers of two threads each would oversubscribe the cores. Set before
    # torch is imported; the subprocesses a test starts inherit it unless they set their own.
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.dist import DistPools  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_configure(config):
    """Build the batch-invariant mode's CPU attention kernel once, before any worker or rank starts (in the
    xdist controller, or the single process): a first build takes ~15 s idle, and ranks that each met a
    cold build inside a timed collective would wait on one another's compiler."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        from parallel import invariant_kernel

        invariant_kernel.kernel()


@pytest.fixture(scope="session")
def dist_pools():
    """Gloo process groups started once per test session (under xdist: once per worker):
    `dist_pools.run(world_size, fn, *args)`. A pool whose call failed or hung restarts on its next
    call; `dist_pools.restart(n)` asks for fresh groups explicitly."""
    pools = DistPools()
    yield pools
    pools.close()


# Seconds of test time per module (set-up included) in a two-worker run on a loaded 2-core machine (`--durations=0`,
# summed by module): the longest modules, rounded. Re-measure when a module's time changes much.
LONG_MODULES = {
    "tests/test_reliability_procs.py": 190, "tests/test_kl_memory.py": 130, "tests/test_docs_commands.py": 110,
    "tests/test_gpu_check_cpu.py": 105, "tests/test_sft.py": 95, "tests/test_async.py": 90,
    "tests/test_bench_rl_vs_trl.py": 30, "tests/test_generate_cli.py": 60, "tests/test_budget.py": 55,
    "tests/test_context_parallel.py": 50, "tests/test_kl_eval.py": 45, "tests/test_layout.py": 45,
    "tests/test_recipe_layouts.py": 45, "tests/test_batch_invariant.py": 40, "tests/test_reliability_reward.py": 40,
    "tests/test_reliability_outputs.py": 35, "tests/test_e2e_real_checkpoint.py": 30, "tests/test_bad_launch.py": 30,
    "tests/test_kl_cpu_peak.py": 30, "tests/test_budget_distill.py": 25,
}


def pytest_collection_modifyitems(config, items):
    """Under xdist (`--dist loadscope`: a module's tests, and so its module-scoped fixtures, stay on one
    worker) the longest modules go first (LONG_MODULES, then the others by their number of slow tests), so that
    a long module does not start last and leave the other worker idle at the end. Within a module the order is
    unchanged."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow: dict[str, int] = {}
    for it in items:
        module = it.nodeid.split("::")[0]
        slow[module] = slow.get(module, 0) + (it.get_closest_marker("slow") is not None)
    items.sort(key=lambda it: (-LONG_MODULES.get(it.nodeid.split("::")[0], 0), -slow[it.nodeid.split("::")[0]]))
