"""The conjugate collectives against single-process autograd, on real gloo ranks."""

import os
import time

import pytest
import torch

from parallel import comm
from tests.dist import DistError


def _collectives(seed):
    import torch.distributed as dist

    g = dist.group.WORLD
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    x_full = torch.randn(3, 4 * n, dtype=torch.float64)
    w = torch.randn(3, 4 * n, dtype=torch.float64)  # same on every rank

    # split then gather is the identity, and gradients flow back whole
    x = x_full.clone().requires_grad_(True)
    with comm.count_comm() as c:
        y = comm.gather_from_tp(comm.split_to_tp(x, g, dim=1), g, dim=1)
        (y * w).sum().backward()
    assert torch.equal(y, x_full)
    # split's backward gathers; gather's backward splits: grad equals w exactly
    assert torch.equal(x.grad, w)
    kinds = c.by_kind()
    assert kinds["all_gather"][0] == 2

    # g: forward sums partials; f: backward sums gradients
    part = torch.full((2,), float(r + 1), dtype=torch.float64, requires_grad=True)
    s = comm.reduce_from_tp(part, g)
    assert torch.equal(s.detach(), torch.full((2,), n * (n + 1) / 2, dtype=torch.float64))
    s.sum().backward()
    assert torch.equal(part.grad, torch.ones(2, dtype=torch.float64))

    a = torch.ones(2, dtype=torch.float64, requires_grad=True)
    b = comm.copy_to_tp(a, g) * (r + 1)
    b.sum().backward()
    assert torch.equal(a.grad, torch.full((2,), n * (n + 1) / 2, dtype=torch.float64))
    return r


def test_collectives_two_ranks(dist_pools):
    assert dist_pools.run(2, _collectives, 0) == [0, 1]


@pytest.mark.slow
def test_collectives_four_ranks(dist_pools):
    assert dist_pools.run(4, _collectives, 1) == [0, 1, 2, 3]


def test_single_process_is_identity():
    x = torch.randn(2, 3)
    with comm.count_comm() as c:
        assert comm.reduce_from_tp(x, None) is x
        assert comm.gather_from_tp(x, None) is x
    assert c.calls == 0


def _fails_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 0 waits here for a rank that is gone: the pool must not hang


def test_pool_reports_failure_without_hanging(dist_pools):
    dist_pools.run(2, _collectives, 2)  # started: the time below is the failure's alone
    t0 = time.monotonic()
    with pytest.raises(DistError, match="boom on rank 1"):
        dist_pools.run(2, _fails_on_rank_one, timeout=60)
    # the failed rank exits, so rank 0's barrier fails at once: no waiting out a grace period
    assert time.monotonic() - t0 < 8.0
    assert dist_pools.run(2, _collectives, 2) == [0, 1]  # the pool restarts after a failure


_HELD: list = []


def _pid_holding(n: int) -> int:
    _HELD.extend(os.open(os.devnull, os.O_RDONLY) for _ in range(n))  # as leaked sockets would be
    return os.getpid()


def test_pool_restarts_before_its_ranks_run_out_of_descriptors(dist_pools):
    """Calls whose process groups pile up sockets in the ranks (each call's groups stay registered): once a
    rank holds more than RESTART_AT_DESCRIPTORS, the next call runs on fresh ranks."""
    from tests.dist import RESTART_AT_DESCRIPTORS

    first = dist_pools.run(2, _pid_holding, 0)
    assert dist_pools.run(2, _pid_holding, 0) == first  # kept across calls
    assert dist_pools.run(2, _pid_holding, RESTART_AT_DESCRIPTORS) == first
    fresh = dist_pools.run(2, _pid_holding, 0)
    assert not set(fresh) & set(first)


def _model_collectives(sp: bool = False):
    import torch.distributed as dist

    from core.config import ModelConfig
    from core.model import build_model

    cfg = ModelConfig(vocab_size=131, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2, intermediate_size=64)
    model = build_model(cfg, tp_group=dist.group.WORLD, seed=0)
    model.sequence_parallel = sp
    ids = torch.randint(0, 131, (2, 8))
    with comm.count_comm() as fwd:
        logits = model(ids)
    with comm.count_comm() as bwd:
        (logits ** 2).sum().backward()
    return fwd.by_kind(), bwd.by_kind(), fwd.max_numel(), bwd.max_numel()


def test_model_issues_megatron_collective_count(dist_pools):
    """Per layer: forward all-reduces the attention and MLP outputs (g); backward all-reduces
    dL/dx once for q,k,v and once for gate,up (f); plus the embedding (g) and the head's input (f).
    Every payload is [B, S, H] activations, never weights or vocab-sized."""
    fwd, bwd, fmax, bmax = dist_pools.run(2, _model_collectives)[0]
    L, B, S, H = 3, 2, 8, 32
    assert fwd == {"all_reduce:sum": (1 + 2 * L, (1 + 2 * L) * B * S * H * 4)}
    assert bwd == {"all_reduce:sum": (2 * L + 1, (2 * L + 1) * B * S * H * 4)}
    assert fmax == bmax == B * S * H


def _seq_collectives():
    """Sequence parallelism's pair against plain tensors: gather_seq is a concatenation whose backward sums every
    rank's gradient and keeps this rank's slice; scatter_seq is that slice of the sum, its backward a concatenation."""
    import torch.distributed as dist

    from parallel.seq_comm import gather_seq, scatter_seq

    g = dist.group.WORLD
    n, r = dist.get_world_size(), dist.get_rank()
    full = torch.arange(2 * 4 * n * 3, dtype=torch.float64).view(2, 4 * n, 3)  # [B, S, H], the same on every rank
    mine = slice(4 * r, 4 * r + 4)
    x = full[:, mine].clone().requires_grad_(True)
    y = gather_seq(x, g)
    assert torch.equal(y, full)
    (y * (r + 1)).sum().backward()  # rank r's gradient (r + 1) everywhere: the sum is n (n + 1) / 2
    assert torch.equal(x.grad, torch.full_like(x, n * (n + 1) / 2))
    part = (full * (r + 1)).requires_grad_(True)  # rank r's partial: the sum is full * n (n + 1) / 2
    with comm.count_comm() as c:
        s = scatter_seq(part, g)
        (s * full[:, mine]).sum().backward()
    assert torch.equal(s.detach(), full[:, mine] * n * (n + 1) / 2)
    want = torch.cat([full[:, 4 * q:4 * q + 4] for q in range(n)], 1)  # every rank's upstream gradient, gathered
    assert torch.equal(part.grad, want)
    return c.by_kind()


def test_sequence_collectives(dist_pools):
    kinds = dist_pools.run(2, _seq_collectives)[0]
    assert kinds == {"reduce_scatter:sum": (1, 2 * 8 * 3 * 8), "all_gather": (1, 2 * 4 * 3 * 8)}


def test_sequence_parallel_model_collective_count(dist_pools):
    """With SP the forward's g's become reduce-scatters of the [B, S, H] partials and its f's all-gathers of
    [B, S/tp, H] slices (plus one before the head); backward mirrors them, gathers each column group's input
    slice again (Megatron's: the slice is what forward kept), and adds an all-reduce of each RMSNorm's weight
    gradient ([H]: 2L + 1 of them) beside the head's f."""
    fwd, bwd, _, _ = dist_pools.run(2, _model_collectives, True)[0]
    L, B, S, H, tp = 3, 2, 8, 32, 2
    act, shard = B * S * H * 4, B * S // tp * H * 4
    assert fwd == {"reduce_scatter:sum": (1 + 2 * L, (1 + 2 * L) * act), "all_gather": (2 * L + 1, (2 * L + 1) * shard)}
    # backward all-gathers: the row layers' and the embedding's dL/dy, and each column group's input slice again
    assert bwd == {"reduce_scatter:sum": (2 * L, 2 * L * act), "all_gather": (4 * L + 1, (4 * L + 1) * shard),
                   "all_reduce:sum": (1 + 2 * L + 1, act + (2 * L + 1) * H * 4)}
