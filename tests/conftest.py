import pytest

from tests.dist import DistPools


@pytest.fixture(scope="module")
def dist_pools():
    """Gloo process groups started once per test module: `dist_pools.run(world_size, fn, *args)`."""
    pools = DistPools()
    yield pools
    pools.close()
