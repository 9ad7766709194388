import pytest

from tests.dist import DistPools


@pytest.fixture(scope="session")
def dist_pools():
    """Gloo process groups started once per test session: `dist_pools.run(world_size, fn, *args)`.
    A pool whose call failed or hung restarts on its next call; `dist_pools.restart(n)` asks for
    fresh groups explicitly."""
    pools = DistPools()
    yield pools
    pools.close()
