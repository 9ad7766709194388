"""Reference sync: hard copy and EMA mix against hand-computed parameters, the schedule (every K
steps, or after the KL stays low), optimizer reset, and state round trip; a 2-rank FSDP check
that syncing sharded copies gives the policy's full weights."""

import torch

from core.config import ModelConfig
from core.model import build_model
from rl.config import ReferenceConfig
from rl.models.reference import ReferenceSync, sync_reference

CFG = ModelConfig(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64)


def _pair():
    return build_model(CFG, seed=1), build_model(CFG, seed=2)


def test_hard_and_ema():
    pol, ref = _pair()
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    sync_reference(pol, ref, "ema", 0.25)
    for n, p in ref.named_parameters():
        want = 0.75 * before[n] + 0.25 * dict(pol.named_parameters())[n].detach()
        torch.testing.assert_close(p.detach(), want, atol=1e-7, rtol=1e-6)
    sync_reference(pol, ref, "hard")
    for (n, a), (_, b) in zip(pol.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n


class _Opt:
    def __init__(self):
        self.opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
        self.opt.state["x"] = {"step": 1}


def test_schedule_every_and_below_with_patience():
    pol, ref = _pair()
    every = ReferenceSync(ReferenceConfig(sync_every=3), kl_target=0.1)
    assert [every.maybe_sync(s, 1.0, pol, ref) for s in range(6)] == [False, False, True, False, False, True]
    below = ReferenceSync(ReferenceConfig(sync_below=0.5, sync_patience=2, reset_optimizer=True), kl_target=0.1)
    opt = _Opt()
    kls = [0.2, 0.01, 0.2, 0.01, 0.02, 0.01, 0.01]  # below 0.05 twice in a row at steps 3-4, then 5-6
    fired = [below.maybe_sync(s, k, pol, ref, opt) for s, k in enumerate(kls)]
    assert fired == [False, False, False, False, True, False, True]
    assert len(opt.opt.state) == 0  # optimizer moments reset after a sync
    state = below.state_dict()
    again = ReferenceSync(ReferenceConfig(sync_below=0.5, sync_patience=2), kl_target=0.1)
    again.load_state_dict(state)
    assert again.state_dict() == state == {"below": 0, "count": 2}


def _sharded_sync():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.fsdp import FSDPOptions, full_tensor, parallelize

    mesh = init_device_mesh("cpu", (2,))
    pol, ref = _pair()
    want = {n: p.detach().clone() for n, p in pol.named_parameters()}
    pol = parallelize(pol, mesh, FSDPOptions())
    ref = parallelize(ref, mesh, FSDPOptions())
    sync_reference(pol, ref, "hard")
    for n, p in ref.named_parameters():
        assert torch.equal(full_tensor(p.detach()), want[n]), n
    return dist.get_rank()


def test_sync_of_fsdp_sharded_copies(dist_pools):
    assert dist_pools.run(2, _sharded_sync) == [0, 1]


# EMA of a bf16 reference: against the recurrence r <- r + alpha (policy - r) in float64, rounded to bf16
# once at the end; the policy drifts by 1e-2 relative over the syncs (alpha x drift per sync is under half
# a bf16 ulp: mixed in bf16 the reference hardly moves).
ALPHA, SYNCS = 0.1, 50


def _drifting_policy(pol, k: int, base: dict, drift: dict) -> None:
    """The policy's parameters set to base (1 + drift (k + 1) / SYNCS), full tensors by name (each
    rank's shard of them when the policy is FSDP-sharded)."""
    from torch.distributed.tensor import distribute_tensor

    from parallel.fsdp import local_tensor

    with torch.no_grad():
        for n, p in pol.named_parameters():
            value = base[n] * (1 + drift[n] * (k + 1) / SYNCS)
            if hasattr(p, "placements"):
                value = local_tensor(distribute_tensor(value, p.device_mesh, p.placements))
            local_tensor(p).copy_(value)


def _bf16_ema_pair():
    ref = build_model(CFG, seed=2).cast_weights(torch.bfloat16)
    pol = build_model(CFG, seed=2)
    g = torch.Generator().manual_seed(5)
    base = {n: p.detach().clone() for n, p in pol.named_parameters()}
    drift = {n: 1e-2 * torch.randn(p.shape, generator=g) for n, p in pol.named_parameters()}
    want = {n: p.detach().double() for n, p in ref.named_parameters()}  # the float64 recurrence
    for k in range(SYNCS):
        _drifting_policy(pol, k, base, drift)
        for n, p in pol.named_parameters():
            want[n] += ALPHA * (p.detach().double() - want[n])
    return ref, pol, base, drift, want


def _within_one_bf16_ulp(got: torch.Tensor, want64: torch.Tensor) -> bool:
    ulp = torch.ldexp(torch.ones_like(want64), torch.frexp(want64.abs())[1] - 8)
    return bool(((got.double() - want64).abs() <= ulp).all())


def test_ema_of_a_bf16_reference_follows_the_float64_recurrence():
    ref, pol, base, drift, want = _bf16_ema_pair()
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    sync = ReferenceSync(ReferenceConfig(sync_every=1, sync_mode="ema", ema_alpha=ALPHA, dtype="bf16"), 0.1)
    for k in range(SYNCS):
        _drifting_policy(pol, k, base, drift)
        assert sync.maybe_sync(k, 1.0, pol, ref)
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in ref.named_parameters())
    should = sum(int((want[n].to(torch.bfloat16) != before[n]).sum()) for n in want)
    assert moved >= 0.9 * should > 0, (moved, should)
    for n, p in ref.named_parameters():
        assert p.dtype == torch.bfloat16 and sync.master[n].dtype == torch.float32, n
        assert _within_one_bf16_ulp(p.detach(), want[n]), n
        # the fp32 copy tracks the float64 recurrence to fp32 rounding
        torch.testing.assert_close(sync.master[n].double(), want[n], rtol=1e-6, atol=1e-9)
    # a hard sync resets the fp32 copy too
    sync_reference(pol, ref, "hard", master=sync.master)
    for n, p in pol.named_parameters():
        assert torch.equal(sync.master[n], p.detach()), n


def _sharded_bf16_ema():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.fsdp import FSDPOptions, freeze, full_tensor, local_tensor, parallelize

    mesh = init_device_mesh("cpu", (2,))
    ref, pol, base, drift, want = _bf16_ema_pair()
    pol = parallelize(pol, mesh, FSDPOptions())
    ref = parallelize(freeze(ref), mesh, FSDPOptions())
    sync = ReferenceSync(ReferenceConfig(sync_every=1, sync_mode="ema", ema_alpha=ALPHA, dtype="bf16"), 0.1)
    for k in range(SYNCS):
        _drifting_policy(pol, k, base, drift)
        sync.maybe_sync(k, 1.0, pol, ref)
    local, full = 0, 0
    for n, p in ref.named_parameters():
        assert sync.master[n].shape == local_tensor(p).shape, n  # sharded exactly like the reference
        local += sync.master[n].numel()
        full += want[n].numel()
        assert _within_one_bf16_ulp(full_tensor(p.detach()), want[n]), n
    assert local <= full // 2 + 64 * CFG.hidden_size  # about half the weights on each rank
    return dist.get_rank()


def test_ema_of_a_bf16_reference_sharded_over_two_ranks(dist_pools):
    assert dist_pools.run(2, _sharded_bf16_ema) == [0, 1]
