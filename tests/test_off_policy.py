"""Off-policy corrections (rl/objectives/off_policy.py) against float64 hand formulas, their start-up checks, the
staleness bound (rl/update/staleness.py), and a synchronous trainer step whose loss a correction changes exactly as
a float64 hand computation from the step's recorded log-probs says."""

import math
from types import SimpleNamespace

import pytest
import torch

from rl.objectives.off_policy import (
    OffPolicyConfig,
    correction_weights,
    loss_inputs,
    staleness_metrics,
    weight_metrics,
)
from rl.update.staleness import StalenessBound

D = torch.float64


def _batch(seed=5):
    """Rows of different lengths, NaN in the padding: log pi_old, log mu, mask [4, 5]."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, generator=g, dtype=D) * 2
    mu = old + torch.randn(4, 5, generator=g, dtype=D) * 0.6
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    old, mu = old.masked_fill(~mask, float("nan")), mu.masked_fill(~mask, float("nan"))
    return old, mu, mask


def _hand(kind, cap, old, mu, mask):
    """c_t by the formulas of the module docstring, one row at a time, in plain float64 Python."""
    out = torch.zeros_like(old)
    for b in range(old.shape[0]):
        idx = [t for t in range(old.shape[1]) if mask[b, t]]
        rho = [math.exp(float(old[b, t] - mu[b, t])) for t in idx]
        prod = math.prod(rho)
        geo = math.exp(sum(math.log(r) for r in rho) / len(rho))
        inf = math.inf if cap is None else cap
        for t, r in zip(idx, rho):
            if kind == "none":
                out[b, t] = 1.0
            elif kind == "tis":
                out[b, t] = min(r, inf)
            elif kind == "seq_tis":
                out[b, t] = min(prod, inf)
            elif kind == "mis":
                out[b, t] = r if 1 / inf <= r <= inf else 0.0
            elif kind == "geo_rs":
                out[b, t] = min(r, inf) if 1 / inf <= geo <= inf else 0.0
            else:
                out[b, t] = r if r <= inf else 0.0
    return out


@pytest.mark.parametrize("kind,cap", [("none", None), ("tis", 1.3), ("seq_tis", 1.5), ("mis", 1.4), ("geo_rs", 1.2),
                                      ("decoupled", None), ("decoupled", 1.5)])
def test_weights_match_hand_formulas(kind, cap):
    old, mu, mask = _batch()
    cfg = OffPolicyConfig(kind, cap)
    c, parts = correction_weights(cfg, old, mu, mask)
    want = _hand(kind, cfg.cap, old, mu, mask)
    torch.testing.assert_close(c, want, atol=1e-14, rtol=1e-12)
    assert not c.requires_grad and bool((c[~mask] == 0).all())
    m = weight_metrics(parts)
    v = want[mask]
    assert m["off_policy_weight_mean"] == pytest.approx(float(v.mean()), rel=1e-12)
    assert m["off_policy_weight_max"] == pytest.approx(float(v.max()), rel=1e-12)
    assert m["off_policy_dropped_share"] == pytest.approx(float((v == 0).double().mean()))
    if kind in ("mis", "geo_rs", "decoupled") and cap is not None:
        assert m["off_policy_dropped_share"] > 0  # the band acts on this batch
    if kind in ("tis", "seq_tis"):
        assert 0 < m["off_policy_truncated_share"] < 1
    if kind == "geo_rs":
        rejected = [b for b in range(4) if mask[b].any() and not want[b][mask[b]].any()]
        assert m["off_policy_rejected_seq_share"] == pytest.approx(len(rejected) / 4) and rejected


def test_config_checks_name_the_key():
    with pytest.raises(ValueError, match="algo.off_policy.correction must be one of"):
        OffPolicyConfig("is")
    with pytest.raises(ValueError, match="algo.off_policy.cap must be > 1"):
        OffPolicyConfig("tis", 1.0)
    with pytest.raises(ValueError, match="algo.off_policy.cap=2.0 with algo.off_policy.correction='none'"):
        OffPolicyConfig("none", 2.0)
    assert OffPolicyConfig("tis").cap == 2.0 and OffPolicyConfig("decoupled").cap is None


def _rl(*over):
    from core.config import load_config
    from rl.config import RLConfig
    return load_config(RLConfig, None, list(over))


def test_biased_combinations_are_refused_at_start_up():
    from core.config import ConfigError
    with pytest.raises(ConfigError, match="kl.is_weight='none' with kl.where='loss' and algo.max_staleness=1"):
        _rl("algo.max_staleness=1", "kl.is_weight=none", "algo.off_policy.correction=decoupled")
    with pytest.raises(ConfigError, match="kl_ctl.mode='grad_ratio'.*algo.off_policy.correction='tis'"):
        _rl("algo.off_policy.correction=tis", "kl_ctl.mode=grad_ratio")
    with pytest.raises(ConfigError, match="algo.max_staleness must be an integer >= 0"):
        _rl("algo.max_staleness=-1")
    with pytest.raises(ConfigError, match="unknown config key 'algo.off_policy.cap_low'"):
        _rl("algo.off_policy.cap_low=0.5")
    # allowed: the KL weighted (pi/mu at staleness), the exact KL (no token weight), the KL in the reward
    _rl("algo.max_staleness=2", "algo.off_policy.correction=decoupled")
    _rl("algo.max_staleness=2", "algo.off_policy.correction=tis", "kl.exact=true", "kl.is_weight=none")
    _rl("algo.max_staleness=2", "algo.off_policy.correction=tis", "kl.where=reward")


def test_naive_ppo_at_staleness_warns_once(caplog):
    from rl.objectives import off_policy
    off_policy._WARNED.clear()
    with caplog.at_level("WARNING", logger="rl.objectives.off_policy"):
        _rl("algo.max_staleness=1")
        _rl("algo.max_staleness=1")
        _rl()  # synchronous: nothing to warn about
        _rl("algo.max_staleness=1", "algo.off_policy.correction=decoupled")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "naive PPO" in msgs[0] and "algo.max_staleness=1" in msgs[0], msgs


def test_a_kl_summed_into_returns_at_staleness_warns(caplog):
    from rl.objectives import off_policy
    off_policy._WARNED.clear()
    with caplog.at_level("WARNING", logger="rl.objectives.off_policy"):
        _rl("algo.max_staleness=1", "algo.off_policy.correction=tis", "kl.where=reward")
        _rl("algo.max_staleness=1", "algo.off_policy.correction=tis", "kl.gradient=sequence")
        _rl("algo.max_staleness=1", "algo.off_policy.correction=tis")  # per token in the loss: nothing
        _rl("kl.where=reward")  # synchronous: nothing
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and all("mu's continuation" in m for m in msgs), msgs


def _cfg(correction="none", max_staleness=0, cap=None):
    return SimpleNamespace(algo=SimpleNamespace(off_policy=OffPolicyConfig(correction, cap),
                                                max_staleness=max_staleness))


def test_loss_inputs_pick_the_anchor_and_the_kl_weight():
    old, mu, mask = _batch()
    data = SimpleNamespace(old_logp=old, rollout_sampled_logprobs=mu, rollout_logprobs=None, mask=mask)
    sync = loss_inputs(_cfg(), data)  # today's objective: clip on pi/pi_old, mu unused
    assert sync.old_logp is old and sync.weights is None and sync.kl_old is None and sync.on_policy_ok
    naive = loss_inputs(_cfg("none", 2), data)  # naive PPO at staleness: clip on pi/mu, no recompute
    assert naive.old_logp is mu and naive.weights is None and not naive.on_policy_ok
    tis = loss_inputs(_cfg("tis", 0), data)
    assert tis.old_logp is old and tis.kl_old is mu and tis.weights is not None and tis.on_policy_ok
    assert "off_policy_weight_mean" in tis.metrics
    # mu falls back to the tempered log-prob where the sampler recorded no truncated one
    data2 = SimpleNamespace(old_logp=old, rollout_sampled_logprobs=None, rollout_logprobs=mu, mask=mask)
    assert loss_inputs(_cfg("tis"), data2).kl_old is mu
    both = SimpleNamespace(old_logp=old, rollout_sampled_logprobs=mu, rollout_logprobs=mu - 0.1, mask=mask)
    assert loss_inputs(_cfg("tis"), both).kl_old is both.rollout_logprobs  # tempered (the default)
    sampled = _cfg("tis")
    sampled.algo.off_policy.behaviour = "sampled"
    assert loss_inputs(sampled, both).kl_old is mu
    with pytest.raises(ValueError, match="recorded no log-probs"):
        loss_inputs(_cfg("tis"), SimpleNamespace(old_logp=old, rollout_sampled_logprobs=None, rollout_logprobs=None,
                                                 mask=mask))


def test_a_batch_staler_than_the_bound_is_refused():
    _, _, mask = _batch()
    data = SimpleNamespace(mask=mask, policy_version=torch.tensor([5, 5, 4, 3]), current_version=5)
    got = staleness_metrics(data, 2)
    assert got == {"staleness_mean": pytest.approx(3 / 4), "staleness_max": 2.0}
    with pytest.raises(ValueError, match="staleness 2 .*algo.max_staleness=1"):
        staleness_metrics(data, 1)
    with pytest.raises(ValueError, match="staleness -1"):
        staleness_metrics(SimpleNamespace(mask=mask, policy_version=torch.tensor([5, 6, 5, 5]), current_version=5), 3)
    mask2 = mask.clone()
    mask2[3] = False  # a dropped row (mask cleared) is no longer counted
    assert staleness_metrics(SimpleNamespace(mask=mask2, policy_version=torch.tensor([5, 5, 4, 1]),
                                             current_version=5), 1)["staleness_max"] == 1.0


def _rollout(B=8, N=3):
    from rl.experience.rollout import Rollout
    return Rollout(torch.zeros(B, 2 + N, dtype=torch.long), torch.ones(B, 2 + N, dtype=torch.long),
                   torch.ones(B, N, dtype=torch.bool), 2, torch.zeros(B), torch.arange(B), [], [])


def test_staleness_bound_drops_rows_and_whole_groups():
    ro = _rollout()
    versions = torch.tensor([7, 7, 6, 6, 5, 7, 4, 4])
    out, m = StalenessBound(1, group_size=1).apply(ro, versions, 7)
    assert out.response_mask.any(1).tolist() == [True, True, True, True, False, True, False, False]
    assert m == {"stale_dropped": 3, "stale_dropped_share": 3 / 8, "staleness_seen_mean": pytest.approx(10 / 8),
                 "staleness_seen_max": 3.0}
    assert ro.response_mask.all()  # the input is left as it was
    out, m = StalenessBound(1, group_size=2).apply(ro, versions, 7)  # row 4 is stale: its group goes too
    assert out.response_mask.any(1).tolist() == [True, True, True, True, False, False, False, False]
    assert m["stale_dropped"] == 4
    same, m = StalenessBound(0).apply(ro, torch.full((8,), 7), 7)  # synchronous: nothing dropped
    assert same is ro and m["stale_dropped"] == 0
    with pytest.raises(ValueError, match="row 1 has policy_version 8, ahead of the current version 7"):
        StalenessBound(2).apply(ro, torch.tensor([7, 8, 7, 7, 7, 7, 7, 7]), 7)
    with pytest.raises(ValueError, match="integer"):
        StalenessBound(2).apply(ro, torch.zeros(8), 7)
    with pytest.raises(ValueError, match="algo.max_staleness must be an integer >= 0"):
        StalenessBound(-1)


def _bound_on_half():
    import torch.distributed as dist
    r = dist.get_rank()
    versions = torch.tensor([[3, 3, 2, 0], [3, 1, 1, 3]][r])
    _, m = StalenessBound(1).apply(_rollout(4), versions, 3, dist.group.WORLD)
    old, mu, mask = _batch()
    rows = slice(2 * r, 2 * r + 2)
    _, parts = correction_weights(OffPolicyConfig("mis", 1.4), old[rows], mu[rows], mask[rows])
    return m, weight_metrics(parts, dist.group.WORLD)


def test_metrics_are_global_over_dp(dist_pools):
    """Two DP ranks, half the rows each: the bound's counts and the weights' metrics equal the one-process ones."""
    one_bound = StalenessBound(1).apply(_rollout(8), torch.tensor([3, 3, 2, 0, 3, 1, 1, 3]), 3)[1]
    old, mu, mask = _batch()
    one_w = weight_metrics(correction_weights(OffPolicyConfig("mis", 1.4), old, mu, mask)[1])
    for m, w in dist_pools.run(2, _bound_on_half):
        assert m == pytest.approx(one_bound)
        assert w == pytest.approx(one_w, rel=1e-12)


# ------------------------------------------------------------------------------------------------------------
# the synchronous trainer: mu from the rollout (a top-k sampler: mu != pi_T), pi_old from the old-log-prob pass


def _sync_step(correction, *extra):
    from tests.test_rl_trainer import _trainer
    torch.set_num_threads(1)
    over = ["algo.name=grpo", "kl.estimator=k3+", "rollout.top_k=64", "kl_ctl.beta=0.1",
            f"algo.off_policy.correction={correction}", "algo.off_policy.behaviour=sampled", *extra]
    trainer, _ = _trainer(1, 1, over, dtype=torch.float64)
    data = trainer.make_experience(0)
    return data, trainer.update(data, 0)


def _hand_parts(data):
    """(mask, A, per-token weight 1/T as the loss holds it (fp32), rho = pi_old/mu, k3+ values) in float64 from a
    step's recorded tensors."""
    from rl.objectives.kl import kl_estimate
    mask, A = data.mask, data.advantages.double()
    per_token = float(torch.ones((), dtype=torch.float32) / int(mask.sum()))
    old, mu = data.old_logp.double(), data.rollout_sampled_logprobs.double()
    rho = torch.where(mask, (old - mu).exp(), 0.0)
    return mask, A, per_token, rho, kl_estimate(old, data.ref_logp.double(), "k3+").detach()


@pytest.mark.slow
def test_a_correction_changes_the_synchronous_loss_as_float64_says():
    """One on-policy update (ratio exactly 1, so the clipped term is -A): the policy-gradient loss is
    sum_t c_t (-A_t) / T and the KL term sum_t min(pi/mu, 10) k3+(t) / T, with c_t and mu from the step's recorded
    log-probs, computed here in float64; with correction=none both are today's (c = 1, weight pi/pi_old = 1).
    Three layouts: shared prompts through the fused loss head, the unfused head, padded rows."""
    data, none = _sync_step("none")
    mask, A, per_token, rho, k3 = _hand_parts(data)
    assert float(rho[mask].max()) < 1.0 and float(rho[mask].min()) > 0.05  # top-k: mu puts more mass on kept ids
    assert float(rho[mask].std()) > 1e-4  # and the weights differ from token to token
    band = 1 / float(rho[mask].median())  # mis's [1/C, C] cuts through them
    assert none["pg_loss"] == pytest.approx(float(-(A[mask]).sum() * per_token), rel=1e-10, abs=1e-12)
    assert none["kl_loss"] == pytest.approx(float(k3[mask].sum() * per_token), rel=1e-10, abs=1e-12)
    for kind, cap, extra in (("tis", 1.5, []), ("mis", band, ["algo.fused_loss=false"]),
                             ("decoupled", None, ["algo.share_prompts=false"])):
        data, got = _sync_step(kind, *([f"algo.off_policy.cap={cap}"] if cap else []), *extra)
        mask, A, per_token, rho, k3 = _hand_parts(data)
        c = _hand_sync(kind, cap, rho, mask)
        assert got["pg_loss"] == pytest.approx(float((c * -A)[mask].sum() * per_token), rel=1e-10, abs=1e-12), kind
        w = (data.old_logp.double() - data.rollout_sampled_logprobs.double()).clamp(max=math.log(10.0)).exp()
        assert got["kl_loss"] == pytest.approx(float((w * k3)[mask].sum() * per_token), rel=1e-10, abs=1e-12), kind
        assert got["pg_loss"] != pytest.approx(none["pg_loss"], rel=1e-3)
        assert got["off_policy_weight_mean"] == pytest.approx(float(c[mask].mean()), rel=1e-10)
        if kind == "mis":
            assert got["off_policy_dropped_share"] == pytest.approx(float((c[mask] == 0).double().mean()))
            assert 0 < got["off_policy_dropped_share"] < 1


def _hand_sync(kind, cap, rho, mask):
    if kind == "tis":
        return rho.clamp(max=cap)
    if kind == "mis":
        return torch.where((rho >= 1 / cap) & (rho <= cap), rho, 0.0)
    return rho


@pytest.mark.slow
def test_the_tempered_behaviour_corrects_the_rollout_training_mismatch():
    """algo.off_policy.behaviour=tempered (the default): mu is the rollout's tempered full-vocabulary log-prob, so
    rho_t = pi_old / pi_rollout is the rollout-vs-training mismatch alone (the same weights, different kernels and
    a float32 record): near 1, not 1, and the loss moves by exactly sum_t (rho_t - 1) (-A_t) / T."""
    from tests.test_rl_trainer import _trainer
    torch.set_num_threads(1)
    trainer, _ = _trainer(1, 1, ["algo.name=grpo", "algo.off_policy.correction=decoupled"], dtype=torch.float64)
    data = trainer.make_experience(0)
    got = trainer.update(data, 0)
    mask, A = data.mask, data.advantages.double()
    rho = torch.where(mask, (data.old_logp.double() - data.rollout_logprobs.double()).exp(), 0.0)
    assert 0 < float((rho[mask] - 1).abs().max()) < 1e-5  # float32 rounding of the record, not a policy gap
    per_token = float(torch.ones((), dtype=torch.float32) / int(mask.sum()))
    assert got["pg_loss"] == pytest.approx(float((rho * -A)[mask].sum() * per_token), rel=1e-9, abs=1e-15)


@pytest.mark.slow
def test_the_update_reads_versions_and_refuses_a_batch_past_the_bound():
    """A step tagged one version stale goes through an update with algo.max_staleness=1 (its staleness in the
    record); the same batch under algo.max_staleness=0 is refused before any forward, naming the bound."""
    from tests.test_rl_trainer import _trainer
    torch.set_num_threads(1)
    over = ["algo.name=grpo", "algo.off_policy.correction=decoupled"]
    trainer, _ = _trainer(1, 1, over + ["algo.max_staleness=1"])
    data = trainer.make_experience(0)
    B = data.mask.shape[0]
    data.policy_version, data.current_version = torch.tensor([3] * (B - 4) + [4] * 4), 4
    got = trainer.update(data, 0)
    assert got["staleness_max"] == 1.0 and got["staleness_mean"] == pytest.approx((B - 4) / B)
    strict, _ = _trainer(1, 1, over)
    before = [p.detach().clone() for p in strict.policy.parameters()]
    with pytest.raises(ValueError, match="staleness 1 .*algo.max_staleness=0"):
        strict.update(data, 0)
    assert all(torch.equal(p, q) for p, q in zip(strict.policy.parameters(), before))


@pytest.mark.slow
def test_naive_ppo_at_staleness_clips_on_pi_over_mu():
    """correction=none with algo.max_staleness > 0: the first mini-batch's ratio is pi/mu (not 1): its mean is
    the float64 mean of exp(log pi_old - log mu) over the step's tokens (pi = pi_old before the first optimizer
    step; top-k puts it near the kept mass), and the clip zeroes every token with A < 0."""
    data, got = _sync_step("none", "algo.max_staleness=1")
    mask, A, per_token, rho, _ = _hand_parts(data)
    ratio = rho[mask]  # pi / mu = pi_old / mu before the first optimizer step
    assert got["ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-9)
    assert got["ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-9) and got["ratio_max"] < 0.8
    assert got["clipfrac"] == pytest.approx(float((A[mask] < 0).double().mean()), rel=1e-12)  # A < 0, r < 0.8
    assert 0 < got["clipfrac"] < 1


@pytest.mark.slow
def test_a_correction_does_not_depend_on_the_layout(dist_pools):
    """Two float64 steps with mis (its band cutting through the top-k weights) and two mini-batches: tp=2 and dp=2
    give the single process's metrics and weights (the weights are per row, their metrics global over DP)."""
    from tests.test_rl_trainer import _compare, _steps_and_logits
    torch.set_num_threads(1)
    over = ["algo.name=grpo", "rollout.top_k=64", "algo.off_policy.correction=mis", "algo.off_policy.cap=3.45",
            "algo.off_policy.behaviour=sampled", "algo.mini_batches=2"]
    keys = ("pg_loss", "kl_loss", "grad_norm", "ratio_mean", "clipfrac", "off_policy_weight_mean",
            "off_policy_weight_max", "off_policy_dropped_share")
    single = _steps_and_logits(1, 1, over, keys=keys)
    assert 0 < single[0][0]["off_policy_dropped_share"] < 1
    for tp, dp in ((2, 1), (1, 2)):
        for got in dist_pools.run(2, _steps_and_logits, tp, dp, over, keys):
            _compare(single, got)


def _old_pass_rows(trainer, monkeypatch):
    """(the step's StepData, rows the old-log-prob pass computes: every local row but the deferred ones)."""
    from rl.update.step_data import ExperienceMaker
    seen, real = [], ExperienceMaker._old_pass

    def spy(self, ro, shared, deferred, **kw):
        seen.append(ro.response_mask.shape[0] - (0 if deferred is None else deferred.numel()))
        return real(self, ro, shared, deferred, **kw)
    monkeypatch.setattr(ExperienceMaker, "_old_pass", spy)
    data = trainer.make_experience(0)
    monkeypatch.undo()
    return data, sum(seen)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tis", "mis", "decoupled", "seq_tis"])
def test_token_level_corrections_take_the_first_mini_batch_s_pi_old_from_the_update(kind, monkeypatch):
    """algo.old_from_update with a token-level correction: the first mini-batch's rows get no old-log-prob pass
    (their c_t comes from the update's own forward, inside the loss); a sequence-level one (seq_tis) still needs
    every row's pi_old first. The update's loss, KL and weight metrics equal the run that recomputes every row
    (float64: the same forward, another batch shape), and the correction's metrics cover every row."""
    from tests.test_rl_trainer import _trainer
    torch.set_num_threads(1)
    over = ["algo.name=grpo", "kl.estimator=k3+", "kl_ctl.beta=0.1", "algo.mini_batches=2", "algo.max_staleness=1",
            f"algo.off_policy.correction={kind}", *([f"algo.off_policy.cap={1.5}"] if kind != "decoupled" else [])]
    got = {}
    for defer in (True, False):
        trainer, _ = _trainer(1, 1, over + [f"algo.old_from_update={str(defer).lower()}"], dtype=torch.float64)
        data, rows = _old_pass_rows(trainer, monkeypatch)
        B = data.mask.shape[0]
        assert rows == (B // 2 if defer and kind != "seq_tis" else B), (defer, rows)
        # mu as an older policy's: the recorded log-probs moved by a fixed +-0.4 pattern, so the weights spread
        # across the cap (truncated, masked and kept tokens all occur)
        g = torch.Generator().manual_seed(5)
        data.rollout_logprobs = data.rollout_logprobs + 0.4 * torch.randn(data.mask.shape, generator=g).double()
        got[defer] = (trainer.update(data, 0), data)
    (a, da), (b, db) = got[True], got[False]
    assert torch.allclose(da.old_logp, db.old_logp, rtol=0, atol=1e-12)  # the deferred rows filled in
    for k in ("pg_loss", "kl_loss", "off_policy_weight_mean", "off_policy_weight_max", "off_policy_truncated_share",
              "off_policy_dropped_share", "grad_norm", "ratio_mean"):
        assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-14), k
    # the metrics against float64 over every row, from the recorded log-probs
    mask = db.mask
    rho = torch.where(mask, (db.old_logp.double() - db.rollout_logprobs.double()).exp(), 0.0)
    if kind != "seq_tis":
        c = _hand_sync(kind, 1.5, rho, mask)
        assert a["off_policy_weight_mean"] == pytest.approx(float(c[mask].mean()), rel=1e-10)
        assert (c[mask] != rho[mask]).any() or kind == "decoupled"  # the cap acts
