import os

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


def pytest_collection_modifyitems(config, items):
    """Under xdist (`--dist loadscope`: a module's tests, and so its module-scoped fixtures, stay on one
    worker) the modules with the most slow tests go first, so that a long module does not start last
    and leave the other worker idle at the end. Within a module the order is unchanged."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow: dict[str, int] = {}
    for it in items:
        module = it.nodeid.split("::")[0]
        slow[module] = slow.get(module, 0) + (it.get_closest_marker("slow") is not None)
    items.sort(key=lambda it: -slow[it.nodeid.split("::")[0]])
