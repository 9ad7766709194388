"""core/optim: the schedule against closed-form values, decoupled weight decay on matrices only,
and the collective skip of non-finite steps (NaN/inf on one rank only: every rank skips).

Clipping and AdamW against torch's own `clip_grad_norm_` + `AdamW` across every layout are in
tests/test_layout.py."""

from __future__ import annotations

import math

import pytest
import torch

from core.config import OptimConfig
from core.model import build_model
from core.optim import OptimConfigError, TrainOptimizer, check_optim_config, lr_at
from parallel.dims import ParallelDims, init_parallel
from parallel.fsdp import FSDPOptions, full_tensor, local_tensor, parallelize
from tests.helpers import global_batch, model_config


def test_warmup_cosine_schedule():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="cosine")
    total = 14  # warmup 4, then cosine over the remaining 10 steps
    want = {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 9: 0.55, 14: 0.1, 30: 0.1}
    for step, lr in want.items():
        assert lr_at(step, cfg, total) == pytest.approx(lr, abs=1e-12), step
    # quarter of the way down: 0.1 + 0.45 * (1 + cos(pi/4))
    assert lr_at(4 + 2.5, cfg, total) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    lrs = [lr_at(s, cfg, total) for s in range(4, 15)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])), "cosine decay is monotone"


def test_constant_and_explicit_decay_steps():
    const = OptimConfig(lr=2.0, warmup_steps=2, schedule="constant")
    assert [lr_at(s, const, 100) for s in (0, 1, 2, 99)] == [1.0, 2.0, 2.0, 2.0]
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=4)
    assert [lr_at(s, cfg, 100) for s in range(6)] == pytest.approx([1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0], abs=1e-6)


@pytest.mark.parametrize("key,value,match", [("schedule", "linear", "optim.schedule"), ("min_lr", 1.0, "optim.min_lr"),
                                             ("lr", 0.0, "optim.lr"), ("betas", (0.9, 1.5), "optim.betas"),
                                             ("implementation", "apex", "optim.implementation")])
def test_bad_optim_config_names_the_key(key, value, match):
    cfg = OptimConfig(lr=0.5)
    setattr(cfg, key, value)
    with pytest.raises(OptimConfigError, match=match):
        check_optim_config(cfg)


def test_weight_decay_applies_to_matrices_only():
    """With zero gradients, AdamW's update is pure decoupled decay: p <- p * (1 - lr * wd)."""
    cfg = model_config("v128_tied_bias_ac")
    model = build_model(cfg, seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = TrainOptimizer(model, OptimConfig(lr=0.1, min_lr=0.1, weight_decay=0.5, warmup_steps=0,
                                            schedule="constant", grad_clip=1.0), cfg, 10)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    stats = opt.step()
    assert stats.grad_norm == 0.0 and not stats.skipped and stats.lr == 0.1
    for n, p in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if p.dim() >= 2 else 1.0  # norms and biases are not decayed
        torch.testing.assert_close(p.detach(), before[n] * factor, atol=0, rtol=1e-6, msg=n)


# foreach: the per-tensor kernel's arithmetic in the same order (equal in fp32); fused: its own order, so
# float64, where rounding differences stay ~1e-16 even after Adam's normalisation magnifies them (in fp32
# the second step's small gradients make them 1e-7 absolute, 1e-5 of the weights)
@pytest.mark.parametrize("implementation,dtype,atol,rtol", [("foreach", torch.float32, 1e-7, 1e-6),
                                                            ("fused", torch.float64, 1e-13, 1e-11)])
def test_step_matches_a_per_tensor_reference(implementation, dtype, atol, rtol):
    """TrainOptimizer (fused or foreach AdamW, foreach norm and clip) against a hand-assembled reference: the
    norm in float64 by a per-parameter loop, torch's clip_grad_norm_ and the per-tensor AdamW (foreach=False),
    over steps where the clip is active and where it is not."""
    cfg = model_config("v128_tied_bias_ac")
    model, ref = build_model(cfg, seed=3, dtype=dtype), build_model(cfg, seed=3, dtype=dtype)
    ocfg = OptimConfig(lr=3e-3, min_lr=3e-3, weight_decay=0.1, warmup_steps=0, schedule="constant", grad_clip=0.5,
                       implementation=implementation)
    opt = TrainOptimizer(model, ocfg, cfg, 10)
    params = dict(ref.named_parameters())
    ropt = torch.optim.AdamW([{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}],
                             lr=3e-3, betas=tuple(ocfg.betas), eps=ocfg.eps, foreach=False)
    ids, _ = global_batch(cfg, "cpu")
    for step, scale in enumerate((1.0, 1e-4, 3.0)):  # clipped, not clipped, clipped
        for m in (model, ref):
            (m(ids).float().pow(2).mean() * scale).backward()
        want = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params.values()))
        torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5, foreach=False)
        ropt.step()
        ropt.zero_grad(set_to_none=True)
        stats = opt.step()
        assert stats.grad_norm == pytest.approx(want, rel=1e-5), step
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), params[n].detach(), atol=atol, rtol=rtol, msg=f"{step} {n}")


def _nonfinite_skip(dp: int, tp: int, bad: str) -> dict:
    import torch.distributed as dist

    cfg = model_config("v131_untied")
    state = init_parallel(ParallelDims(dp, tp), "cpu", cfg.n_heads, cfg.n_kv_heads)
    model = parallelize(build_model(cfg, state.tp_group, seed=5), state.dp_mesh, FSDPOptions())
    opt = TrainOptimizer(model, OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"), cfg, 10,
                         state.tp_group, state.dp_group)
    ids, tgt = global_batch(cfg, "cpu")
    rows = slice(state.dp_rank * 4 // dp, (state.dp_rank + 1) * 4 // dp)  # this DP rank's part of 4 rows

    def backward():
        model(ids[rows]).float().pow(2).mean().backward()

    snapshot = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    backward()
    if dist.get_rank() == 1:  # a non-finite gradient on one rank only
        local_tensor(dict(model.named_parameters())["layers.1.mlp.w_down.weight"].grad).view(-1)[0] = float(bad)
    stats = opt.step()
    unchanged = all(torch.equal(full_tensor(p.detach()), snapshot[n]) for n, p in model.named_parameters())
    grads_cleared = all(p.grad is None for p in model.parameters())
    no_state = len(opt.opt.state) == 0
    backward()
    stats2 = opt.step()  # the next, finite step proceeds on every rank
    changed = any(not torch.equal(full_tensor(p.detach()), snapshot[n]) for n, p in model.named_parameters())
    return {"skipped": stats.skipped, "norm_finite": math.isfinite(stats.grad_norm), "unchanged": unchanged,
            "grads_cleared": grads_cleared, "no_state": no_state, "skipped_total": stats2.skipped_total,
            "skipped2": stats2.skipped, "changed": changed, "lr": stats.lr}


@pytest.mark.parametrize("dp,tp,bad", [(2, 1, "nan"), (1, 2, "inf")])
def test_nonfinite_gradient_on_one_rank_skips_everywhere(dist_pools, dp, tp, bad):
    out = dist_pools.run(2, _nonfinite_skip, dp, tp, bad)
    want = {"skipped": True, "norm_finite": False, "unchanged": True, "grads_cleared": True, "no_state": True,
            "skipped_total": 1, "skipped2": False, "changed": True, "lr": 1e-2}
    assert out == [want, want]
