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
