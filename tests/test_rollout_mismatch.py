"""The rollout-vs-training mismatch metrics against hand formulas, the exact KL(rollout || train) head
against float64 enumeration, and the KL the controller reads under a truncated sampler (top-p) against
the exact KL(pi || ref) enumerated in float64."""

import copy
import math

import pytest
import torch

from rl.health.mismatch import logp_mismatch
from rl.update.logprobs import policy_token_stats


def test_logp_mismatch_matches_hand_formulas():
    a = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -7.0]])
    b = torch.tensor([[-1.05, -2.3, -0.5], [-2.0, -0.1, 99.0]])  # the last token is padding
    mask = torch.tensor([[True, True, True], [True, True, False]])
    pairs = [(-1.0, -1.05), (-2.0, -2.3), (-0.5, -0.5), (-3.0, -2.0), (-0.1, -0.1)]  # (rollout, train), unmasked
    d = [abs(r - t) for r, t in pairs]
    out_band = [not 0.9 <= math.exp(t - r) <= 1.1 for r, t in pairs]  # ratio pi_train / pi_rollout
    got = logp_mismatch(a, b, mask)
    assert math.isclose(got["rollout_logp_diff_max"], 1.0, rel_tol=1e-6)
    assert math.isclose(got["rollout_logp_diff_mean"], sum(d) / 5, rel_tol=1e-6)
    assert math.isclose(got["rollout_ratio_out_share"], sum(out_band) / 5)
    assert sum(out_band) == 2  # exp(-0.3) = 0.74 and exp(1) = 2.7 leave the band; exp(-0.05) = 0.95 does not
    assert math.isclose(got["token_mult_prob_error"], sum(math.exp(x) for x in d) / 5, rel_tol=1e-6)
    empty = logp_mismatch(a, b, torch.zeros_like(mask))
    assert empty["token_mult_prob_error"] == 1.0 and empty["rollout_logp_diff_max"] == 0.0


def _step_data(rank=None):
    """A stand-in StepData (the fields mismatch_metrics reads) of 6 rows; `rank` 0/1: its half of the rows."""
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(6, 4, generator=g, dtype=torch.float64) * 3
    d = torch.randn(6, 4, generator=g, dtype=torch.float64) * 0.08
    mask = torch.rand(6, 4, generator=g) < 0.8
    trunc = torch.rand(6, 4, generator=g, dtype=torch.float64) * 0.1
    kl = torch.rand(6, 4, generator=g, dtype=torch.float64) * 1e-3
    rows = slice(None) if rank is None else slice(3 * rank, 3 * rank + 3)
    return SimpleNamespace(mask=mask[rows], old_logp=old[rows], rollout_logprobs=(old + d)[rows],
                           rollout_sampled_logprobs=(old + d + trunc)[rows], rollout_kl=kl[rows], deferred=None)


def _metrics_on_half():
    import torch.distributed as dist

    from rl.health.mismatch import mismatch_metrics
    return mismatch_metrics(_step_data(dist.get_rank()), dist.group.WORLD)


def test_mismatch_metrics_are_global_over_dp(dist_pools):
    """Each DP rank holds half the rows: every metric equals the one-process value over all rows, and that one
    its hand formula."""
    from rl.health.mismatch import mismatch_metrics
    data = _step_data()
    one = mismatch_metrics(data)
    m = data.mask
    d = (data.rollout_logprobs - data.old_logp)[m]
    kl = data.rollout_kl[m].sort().values
    want = {"rollout_logp_diff_max": d.abs().max(), "rollout_logp_diff_mean": d.abs().mean(),
            "rollout_ratio_out_share": ((-d).exp().lt(0.9) | (-d).exp().gt(1.1)).double().mean(),
            "token_mult_prob_error": d.abs().exp().mean(),
            "sampler_trunc_kl": (data.rollout_sampled_logprobs - data.rollout_logprobs)[m].mean(),
            "rollout_kl_mean": kl.mean(), "rollout_kl_max": kl[-1], "rollout_kl_p50": kl.quantile(0.5),
            "rollout_kl_p99": kl.quantile(0.99)}
    assert 0 < want["rollout_ratio_out_share"] < 1
    for k, v in want.items():
        assert one[k] == pytest.approx(float(v), rel=1e-5, abs=1e-9), k
    for got in dist_pools.run(2, _metrics_on_half):
        for k, v in one.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-9), k


def test_rollout_kl_head_matches_float64_enumeration():
    """`rollout_hidden` through the policy's head: KL(softmax(h_r W / T) || softmax(h W / T)) per token."""
    from core.config import ModelConfig
    from core.model import build_model
    cfg = ModelConfig(vocab_size=67, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=32,
                      max_seq_len=32)
    model = build_model(cfg, seed=2)
    with torch.no_grad():
        model.head_weight.mul_(10)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(3, 67, (3, 9), generator=g)
    am = torch.ones_like(seq)
    P, T = 4, 0.8
    with torch.no_grad():
        h, w = model(seq, attention_mask=am, head=lambda h, w: (h[:, P - 1:-1], w))
    hr = h + 0.05 * torch.randn(h.shape, generator=g)  # a rollout whose hidden states differ a little
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    with torch.no_grad():
        st = policy_token_stats(model, seq, am, P, vocab_size=67, temperature=T, mask=mask, rollout_hidden=hr)
    lq = torch.log_softmax((hr.double() @ w.double().T)[..., :67] / T, -1)
    lp = torch.log_softmax((h.double() @ w.double().T)[..., :67] / T, -1)
    ref = (lq.exp() * (lq - lp)).sum(-1).masked_fill(~mask, 0.0)
    assert ref[mask].min() > 1e-4
    torch.testing.assert_close(st.rollout_kl.double(), ref, atol=1e-6, rtol=1e-4)


def _exact_kl(policy, ref, ro, T):
    """float64 KL(pi_T || ref_T) at every response position, by enumeration of the whole vocabulary."""
    P = ro.prompt_len
    out = []
    for m in (policy, ref):
        with torch.no_grad():
            h, w = m(ro.sequences, attention_mask=ro.attention_mask, head=lambda h, w: (h[:, P - 1:-1], w))
        out.append(torch.log_softmax((h.double() @ w.double().T)[..., :256] / T, -1))
    lp, lr = out
    return (lp.exp() * (lp - lr)).sum(-1)


def test_truncated_sampler_kl_metric_is_the_exact_kl():
    """top_p=0.9: the samples come from mu (the nucleus), not pi, so the sampled estimate of KL(pi||ref)
    reads low. The KL the controller and guards read (the record's kl_mean) is the exact one."""
    from rl.objectives.kl import masked_mean
    from tests.test_rl_trainer import _trainer
    tr, _ = _trainer(1, 1, ["rollout.top_p=0.9", "rollout.temperature=0.8", "rollout.max_new_tokens=8",
                            "kl.estimator=k3+"], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        tr.policy.head_weight.mul_(6)
        tr.ref.head_weight.mul_(6)
        for p in tr.policy.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    policy0 = copy.deepcopy(tr.policy)  # the policy the rollout sampled from, before the update
    seen = {}
    make = tr.make_experience
    tr.make_experience = lambda step: seen.setdefault("data", make(step))
    rec = tr.step(0)
    data = seen["data"]
    truth = float(masked_mean(_exact_kl(policy0, tr.ref, data.ro, 0.8), data.mask))
    sampled = float(masked_mean(data.kl, data.mask))
    assert truth > 0.05
    assert abs(sampled - truth) > 0.1 * truth  # the estimate off mu's samples is not the KL
    assert math.isclose(rec["kl_mean"], truth, rel_tol=1e-4)
    assert rec["sampler_trunc_kl"] > 0.0


@pytest.mark.parametrize("over", [
    pytest.param(["algo.old_from_update=true", "algo.mini_batches=2"], id="deferred-fused"),
    pytest.param(["algo.old_from_update=true", "algo.fused_loss=false"], id="all-deferred-unfused",
                 marks=pytest.mark.slow),
    pytest.param(["algo.old_from_update=false", "algo.micro_batch_tokens=64"], id="old-pass-token-budget",
                 marks=pytest.mark.slow)])
def test_step_rollout_kl_equals_float64_enumeration(over):
    """Every row's exact KL(rollout || train), whether the old pass or the update's on-policy forward computed it,
    against float64 enumeration from the rollout's hidden states (perturbed, so the KL is not 0) and the hidden
    states of a full forward of the policy before the update."""
    from rl.experience.rollout import collect_rollout
    from tests.test_rl_trainer import _trainer
    tr, st = _trainer(1, 1, over, dtype=torch.float64)
    c = tr.cfg
    ro = collect_rollout(tr.policy, tr.tok, tr.task, tr.reward_fn, c.rollout, seed=c.train.seed, step=0,
                         device=st.device)
    g = torch.Generator().manual_seed(3)
    ro.rollout_hidden = ro.rollout_hidden + 0.3 * torch.randn(ro.rollout_hidden.shape, generator=g,
                                                               dtype=ro.rollout_hidden.dtype)
    policy0 = copy.deepcopy(tr.policy)
    data = tr.experience.make_experience(ro, 0)
    assert (data.deferred is not None) == ("algo.old_from_update=true" in over)
    tr.update(data, 0)
    P, T = ro.prompt_len, tr.heads.temperature
    with torch.no_grad():
        h, w = policy0(ro.sequences, attention_mask=ro.attention_mask, head=lambda h, w: (h[:, P - 1:-1], w))
        lq = torch.log_softmax((ro.rollout_hidden.double() @ w.double().T)[..., :256] / T, -1)
        lp = torch.log_softmax((h.double() @ w.double().T)[..., :256] / T, -1)
    ref = (lq.exp() * (lq - lp)).sum(-1).masked_fill(~data.mask, 0.0)
    assert ref[data.mask].min() > 1e-6 and ref[data.mask].mean() > 1e-4
    torch.testing.assert_close(data.rollout_kl.double(), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_bf16_step_records_a_small_mismatch():
    """A bf16 step: every mismatch metric present, the rollout's log-probs within bf16 noise of the
    old pass's and far inside the ratio band."""
    from tests.test_rl_trainer import _trainer
    tr, _ = _trainer(1, 1, ["parallel.mixed_precision=bf16", "algo.old_from_update=false"])
    rec = tr.step(0)
    for k in ("rollout_logp_diff_max", "rollout_logp_diff_mean", "rollout_ratio_out_share", "token_mult_prob_error",
              "rollout_kl_mean", "rollout_kl_p50", "rollout_kl_p99", "rollout_kl_max", "sampler_trunc_kl"):
        assert k in rec and math.isfinite(rec[k]), k
    assert rec["rollout_logp_diff_max"] < 0.05 and rec["rollout_ratio_out_share"] == 0.0
    assert 1.0 <= rec["token_mult_prob_error"] < 1.01 and abs(rec["rollout_kl_max"]) < 1e-3


def test_monitor_draws_the_rollout_kl_quantiles(tmp_path):
    """The TensorBoard writer (a recording stand-in: the optional extra may be absent) gets the mismatch
    scalars under their metrics.jsonl names and the rollout KL's quantiles as one histogram."""
    from core.runtime.monitor import Monitor
    calls = []

    class Writer:
        def add_scalar(self, k, v, step):
            calls.append(("scalar", k, v))

        def add_histogram(self, k, v, step):
            calls.append(("hist", k, [float(x) for x in v]))

        def flush(self):
            pass
    mon = Monitor(str(tmp_path))
    mon.tb = Writer()
    rec = {"step": 3, "rollout_kl_p50": 1e-7, "rollout_kl_p99": 2e-6, "rollout_kl_max": 5e-6,
           "token_mult_prob_error": 1.0001, "rollout_ratio_out_share": 0.0}
    mon.log(rec, 3)
    assert ("hist", "rollout_kl_quantiles", [1e-7, 2e-6, 5e-6]) in calls
    assert ("scalar", "token_mult_prob_error", 1.0001) in calls and ("scalar", "rollout_ratio_out_share", 0.0) in calls
    assert not any(c[1] == "kl_quantiles" for c in calls)  # no KL quantiles in this record: no empty histogram


def test_rollout_select_keeps_the_records_of_its_rows():
    from rl.experience.rollout import Rollout
    B, P, N, H = 4, 2, 3, 5
    lp, lmu, hid = torch.randn(B, N), torch.randn(B, N), torch.randn(B, N, H)
    ro = Rollout(torch.zeros(B, P + N, dtype=torch.long), torch.ones(B, P + N), torch.ones(B, N, dtype=torch.bool),
                 P, torch.zeros(B), torch.arange(B), [{}], [], lp, lmu, hid)
    rows = torch.tensor([2, 0])
    sub = ro.select(rows)
    assert torch.equal(sub.rollout_logprobs, lp[rows]) and torch.equal(sub.rollout_sampled_logprobs, lmu[rows])
    assert torch.equal(sub.rollout_hidden, hid[rows])
    bare = Rollout(*[getattr(ro, f) for f in ("sequences", "attention_mask", "response_mask", "prompt_len", "scores",
                                              "row_ids", "metas", "responses")])
    assert bare.select(rows).rollout_logprobs is None


@pytest.mark.parametrize("over", [["kl.estimator=k3+"], ["kl.exact=true"]], ids=["k3", "exact"])
def test_old_pass_runs_each_head_matmul_once(monkeypatch, over):
    """The old pass with the rollout's hidden states: under a sampled estimator the policy's logits are
    computed once per chunk and the rollout's beside them (2 head matmuls, the reference's weight never
    read: the reference's log-probs come from the reference pass); with the exact KL to the reference the
    reference takes the head's other side and the mismatch KL a second pass (4). The test model's tokens
    fit in one chunk. The values are checked against float64 enumeration above."""
    from parallel.fused import HeadMatmul
    from rl.experience.rollout import collect_rollout
    from tests.test_rl_trainer import _trainer
    tr, st = _trainer(1, 1, ["algo.old_from_update=false", *over])
    c = tr.cfg
    ro = collect_rollout(tr.policy, tr.tok, tr.task, tr.reward_fn, c.rollout, seed=c.train.seed, step=0,
                         device=st.device)
    calls, inside = [], []
    real_call, real_pass = HeadMatmul.__call__, tr.experience._old_pass

    def spy(self, h, keep=None):
        if inside:
            calls.append(self.w.data_ptr())
        return real_call(self, h, keep)

    def old_pass(*a, **kw):
        inside.append(1)
        try:
            return real_pass(*a, **kw)
        finally:
            inside.clear()
    monkeypatch.setattr(HeadMatmul, "__call__", spy)
    monkeypatch.setattr(tr.experience, "_old_pass", old_pass)
    data = tr.experience.make_experience(ro, 0)
    assert data.rollout_kl is not None and data.rollout_kl[data.mask].abs().max() < 1e-4
    pol_w = tr.policy.head_weight.data_ptr()
    if over == ["kl.estimator=k3+"]:
        assert calls == [pol_w, pol_w]
    else:  # the reference's side: the head weight the reference pass handed over (a copy)
        assert len(calls) == 4 and calls[0] == calls[2] == calls[3] == pol_w and calls[1] != pol_w


def test_update_takes_the_deferred_rows_mismatch_kl_from_its_own_logits(monkeypatch):
    """The rows deferred to the update (epoch 0's first mini-batch) get their KL(rollout || train) inside the
    loss head: per chunk the policy's logits once and the rollout's beside them, so one epoch of two
    mini-batches multiplies by the head 3 times (2 for the deferred mini-batch, 1 for the other), not 4 (the
    policy's logits again in a separate pass). The values: test_step_rollout_kl_equals_float64_enumeration."""
    from parallel.fused import HeadMatmul
    from rl.experience.rollout import collect_rollout
    from tests.test_rl_trainer import _trainer
    tr, st = _trainer(1, 1, ["algo.old_from_update=true", "algo.mini_batches=2", "algo.epochs=1",
                             "kl.estimator=k3+"])
    c = tr.cfg
    ro = collect_rollout(tr.policy, tr.tok, tr.task, tr.reward_fn, c.rollout, seed=c.train.seed, step=0,
                         device=st.device)
    data = tr.experience.make_experience(ro, 0)
    assert data.deferred is not None
    calls, real_call = [], HeadMatmul.__call__

    def spy(self, h, keep=None):
        calls.append(self.w.data_ptr())
        return real_call(self, h, keep)
    monkeypatch.setattr(HeadMatmul, "__call__", spy)
    tr.update(data, 0)
    assert calls == [tr.policy.head_weight.data_ptr()] * 3
    assert data.rollout_kl[data.deferred].abs().max() < 1e-4
