"""Numerical truth of the vocab-parallel statistics against float64 and
device discipline: bf16 heads produce fp32 logits (no bf16 rounding before the fp32
reductions), -inf logits are exact zeros of probability, a large constant offset between policy
and reference costs no precision, and every head runs on the meta device without a CPU tensor."""

import ast
import pathlib

import pytest
import torch

from bench.bench_bf16_kl import audit_case, true_kl
from parallel.fused import fused_head
from parallel.fused_loss import fused_head_loss
from parallel.vocab import (
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_log_softmax,
    vocab_parallel_logprobs,
    vocab_parallel_logsumexp,
)

INF = float("inf")


def test_bf16_heads_have_fp32_logits_exact_kl_within_1e_4():
    h, w, wr = audit_case(T=48, H=64, V=4096, seed=1)
    truth = true_kl(h, w, wr)
    assert truth.mean() > 3e-4  # the audit's regime: KL ~ 1e-3, logits ~ N(20, 7.7)
    fused = fused_head(h, w, ref_weight_local=wr, kl="forward", entropy=False, chunk_size=16).kl
    _, st = fused_head_loss(h, w, ref_weight_local=wr, kl="forward", entropy=False, chunk_size=16,
                            token_loss=lambda lp, ent, kl, tok: kl)
    rounded = vocab_parallel_kl(h @ w.T, h @ wr.T)  # logits rounded to bf16 first: the noise floor
    for name, kl in (("fused", fused), ("fused_loss", st.kl)):
        assert kl.dtype == torch.float32
        err = (kl.double() - truth).abs().max().item()
        assert err <= 1e-4, (name, err)
    assert (rounded.double() - truth).abs().mean().item() > 5e-4  # the case does expose bf16 logits


def _log_softmax64(x):
    return torch.log_softmax(x.double(), -1)


def _kl64(x, y):
    """float64 KL(p||q) with 0 log 0 = 0, differentiable at -inf logits (double where)."""
    lp, lq = _log_softmax64(x), _log_softmax64(y)
    live = lp > -INF
    lps = torch.where(live, lp, 0.0)
    return torch.where(live, lps.exp() * (lps - lq), 0.0).sum(-1)


def _entropy64(x):
    lp = _log_softmax64(x)
    live = lp > -INF
    lps = torch.where(live, lp, 0.0)
    return -torch.where(live, lps.exp() * lps, 0.0).sum(-1)


def test_minus_inf_logits_are_exact_zero_probability():
    g = torch.Generator().manual_seed(0)
    T, V = 6, 23
    x = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    y = x + torch.randn(T, V, generator=g, dtype=torch.float64)
    x[:, [3, 5]] = -INF  # col 5: p = 0 and q = 0; col 3: p = 0 only
    y[:, 5] = -INF
    x2 = x.clone()
    x2[:, 3] = 0.0  # only col 5 at -inf on both sides: KL(q||p) finite too
    c = torch.randn(T, generator=g, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        xa, ya, x2a = (v.to(dtype).requires_grad_(True) for v in (x, y, x2))
        xr, yr, x2r = (v.clone().requires_grad_(True) for v in (x, y, x2))
        tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
        pairs = [(vocab_parallel_entropy(xa, chunk_size=4), _entropy64(xr), xa, xr, ya, yr),
                 (vocab_parallel_kl(xa, ya, grad_q=True, chunk_size=4), _kl64(xr, yr), xa, xr, ya, yr),
                 (vocab_parallel_kl(x2a, ya, direction="reverse", grad_q=True), _kl64(yr, x2r), x2a, x2r, ya, yr)]
        for i, (ours, ref, a, ar, b, br) in enumerate(pairs):
            assert torch.isfinite(ours).all(), (i, dtype)
            torch.testing.assert_close(ours.double(), ref, **tol, msg=f"value {i} {dtype}")
            ga, gb = torch.autograd.grad((ours * c.to(dtype)).sum(), [a, b], allow_unused=True)
            ra, rb = torch.autograd.grad((ref * c).sum(), [ar, br], allow_unused=True)
            assert torch.isfinite(ga).all(), (i, dtype)
            torch.testing.assert_close(ga.double(), ra, **tol, msg=f"grad {i} {dtype}")
            if i > 0:
                assert torch.isfinite(gb).all(), (i, dtype)
                torch.testing.assert_close(gb.double(), rb, **tol, msg=f"grad q {i} {dtype}")
    # q = 0 where p > 0: the KL is +inf (documented), not NaN
    assert (vocab_parallel_kl(y, x, direction="forward") == INF).all()
    assert (vocab_parallel_kl(x, y, direction="reverse") == INF).all()
    assert torch.isfinite(vocab_parallel_logsumexp(x)).all()
    lsm = vocab_parallel_log_softmax(x)
    torch.testing.assert_close(lsm, _log_softmax64(x), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_large_offset_between_policy_and_reference_costs_no_precision(direction):
    g = torch.Generator().manual_seed(1)
    T, V = 16, 300
    x = (torch.randn(T, V, generator=g, dtype=torch.float64) * 2).float()
    y = (x.double() + 1e4 + torch.randn(T, V, generator=g, dtype=torch.float64) * 1e-3).float()
    xr, yr = x.double().requires_grad_(True), y.double().requires_grad_(True)
    ref = _kl64(xr, yr) if direction == "forward" else _kl64(yr, xr)
    assert ref.max() < 1e-5  # the offset alone changes nothing: the true KL is tiny
    xa, ya = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    kl = vocab_parallel_kl(xa, ya, direction=direction, grad_q=True, chunk_size=5)
    assert (kl.double() - ref).abs().max().item() < 1e-6
    c = torch.randn(T, generator=g, dtype=torch.float64)
    gx, gy = torch.autograd.grad((kl * c.float()).sum(), [xa, ya])
    rx, ry = torch.autograd.grad((ref * c).sum(), [xr, yr])
    torch.testing.assert_close(gx.double(), rx, atol=1e-6, rtol=0)
    torch.testing.assert_close(gy.double(), ry, atol=1e-6, rtol=0)
    # log-probs at an offset of 1e4: (z_y - max) - log S, not z_y - lse
    t = torch.randint(0, V, (T,), generator=g)
    lp = vocab_parallel_logprobs(y, t)
    want = _log_softmax64(y).gather(1, t[:, None])[:, 0]
    assert (lp.double() - want).abs().max().item() < 1e-5


def _meta(*xs):
    return [x.to("meta") for x in xs]


def test_heads_run_on_meta_device():
    """Every tensor the heads create follows the inputs' device: with all inputs on `meta` the
    outputs and gradients are on `meta` too (a CPU tensor made inside would raise or show)."""
    T, H, V, Vp = 10, 6, 29, 32
    h, w, hr, wr = _meta(torch.randn(T, H), torch.randn(Vp, H), torch.randn(T, H), torch.randn(Vp, H))
    t, keep = _meta(torch.randint(0, V, (T,)), torch.ones(T, dtype=torch.bool))
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [x.to(dtype).requires_grad_(True) for x in (h, w, hr, wr)]
        out = fused_head(leaves[0], leaves[1], t, vocab_size=V, ref_hidden=leaves[2], ref_weight_local=leaves[3],
                         kl="forward", chunk_size=4, mask=keep, temperature=0.7)
        grads = torch.autograd.grad(sum(o.sum() for o in out), leaves)
        assert all(o.device.type == "meta" for o in (*out, *grads))
        loss, st = fused_head_loss(leaves[0], leaves[1], t, vocab_size=V, ref_hidden=hr.to(dtype),
                                   ref_weight_local=wr.to(dtype), kl="reverse", chunk_size=4, mask=keep,
                                   token_loss=lambda lp, ent, kl, tok: lp * 0.5 + ent + kl)
        grads = torch.autograd.grad(loss, leaves[:2])
        assert all(x.device.type == "meta" for x in (loss, *st[:3], *grads))
    x, y = _meta(torch.randn(2, 5, Vp), torch.randn(2, 5, Vp))
    x.requires_grad_(True)
    tt, m = t.reshape(2, 5), keep.reshape(2, 5)
    outs = [vocab_parallel_logsumexp(x, vocab_size=V, mask=m), vocab_parallel_logprobs(x, tt, vocab_size=V),
            vocab_parallel_cross_entropy(x, tt, vocab_size=V), vocab_parallel_entropy(x, vocab_size=V, chunk_size=3),
            vocab_parallel_kl(x, y, vocab_size=V, grad_q=True), vocab_parallel_log_softmax(x, vocab_size=V)]
    (gx,) = torch.autograd.grad(sum(o.sum() for o in outs), [x])
    assert all(o.device.type == "meta" for o in (*outs, gx))


FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "rand", "randn", "randint", "eye", "linspace",
             "as_tensor", "randperm"}


def test_parallel_tensor_factories_name_a_device():
    """Walk parallel/*.py: every torch.<factory>(...) call passes device= (or follows its input)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "parallel"
    bad = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)):
                bad.append(f"{path.name}:{node.lineno} torch.{node.func.attr}")
    assert not bad, "tensor factories without device=: " + ", ".join(bad)
