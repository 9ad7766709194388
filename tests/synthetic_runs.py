"""Synthetic metrics.jsonl records with the statistics of real runs, for the symptom detectors' tests.

A run is a set of true trajectories (per step: the reward's success probability, the mean per-token KL,
entropy, response length, ...) from which each step's logged statistics are *sampled* as the trainer
measures them:

- `reward_mean` is the mean of `samples` (256 = 32 prompts x 8) 0/1 rewards drawn at the step's true
  probability (standard error ~0.03 a step), `reward_std` their standard deviation;
- the per-token KL of the step's ~256 x response-length tokens is lognormal (sigma 1.7-2.1: p99 about
  13-15x the mean and the largest 1% of tokens carrying 0.3-0.45 of it, as in the README's job), from
  which `kl_mean`, `kl_p50/p90/p99`, `kl_max` and `kl_top1_share` are computed; step 0 has KL exactly 0;
- the true KL wanders around its trajectory (an AR(1) factor on the log scale: a policy drifts);
- `ratio_min`/`ratio_max` (pi/pi_old) and `ref_log_ratio_min`/`_max` (log pi/ref) scatter as on the
  README's job (200 steps measured: ratio_min median 0.46, lowest 0.018; ratio_max median 1.5, highest
  3.8; log(pi/ref) max median 5.4, 90% 8.4, highest 9.8, growing with the KL);
- `beta` follows Ziegler's controller on the logged KL (target 0.2, 10 steps' horizon, floor 0.001),
  as configs/grpo_tiny.yaml does.

`healthy_truth(rng, n)` draws trajectories around the README's default job (means over 20-step windows:
reward 0.314 -> 0.680, KL 0.086 -> 0.361 nats/token, beta 0.0134 -> 0.0443, entropy 1.00 -> 0.43),
each run with its own scale and pace; `sample(rng, truth)` turns trajectories into records; FAULTS
builds one faulty run per symptom (the healthy trajectories with the fault put in).
"""

from __future__ import annotations

import math

import numpy as np

SAMPLES = 256
VOCAB = 256
# (step, mean KL) of the README's default job: 0 at step 0, its 20-step window means at their centres
README_KL = ((0, 0.0), (6, 0.08), (20, 0.10), (50, 0.157), (90, 0.239), (130, 0.331), (170, 0.302), (190, 0.361),
             (200, 0.36))


def healthy_truth(rng: np.random.Generator, n: int = 200) -> dict:
    """True per-step trajectories of a healthy GRPO run like the README's job, with this run's own scale
    (KL x0.7-1.4, reward start and end, entropy) and pace (x0.8-1.25)."""
    t = np.arange(n, dtype=float)
    pace = rng.uniform(0.8, 1.25)
    xs, ys = zip(*README_KL)
    kl = np.interp(np.minimum(t * pace, 200.0), xs, ys) * rng.uniform(0.7, 1.4)
    wobble = np.zeros(n)
    for i in range(1, n):  # AR(1) on the log scale: the policy drifts for a few steps
        wobble[i] = 0.7 * wobble[i - 1] + rng.normal(0, 0.08)
    kl = kl * np.exp(wobble)
    p0, p1, tau = rng.uniform(0.25, 0.35), rng.uniform(0.6, 0.75), rng.uniform(100, 250)
    reward = p0 + (p1 - p0) * (1 - np.exp(-t * pace / tau)) / (1 - math.exp(-200 / tau))
    e1 = rng.uniform(0.35, 0.5)
    entropy = e1 + (1.02 - e1) * np.exp(-t * pace / 110)
    length = rng.uniform(3.5, 5.5) + rng.uniform(-0.3, 0.3) * t / 200
    return {"reward": np.clip(reward, 0, 1), "kl": kl, "entropy": entropy, "length": length,
            "repetition": np.full(n, rng.uniform(0.0, 0.05)), "adv": np.full(n, rng.uniform(0.6, 0.85)),
            "ratio_log": np.full(n, rng.uniform(0.6, 1.0)), "grad_norm": np.full(n, rng.uniform(0.2, 1.0)),
            "sigma": rng.uniform(1.7, 2.1), "beta0": 0.02, "target": 0.2, "horizon_steps": 10.0, "beta_min": 0.001,
            "beta_fixed": None, "k1": False, "tail": None}


def _kl_tokens(rng, kl: np.ndarray, tokens: np.ndarray, truth: dict) -> np.ndarray:
    """Per-token KL [steps, max tokens], +inf past each step's token count."""
    n, width = len(kl), int(tokens.max())
    z = rng.standard_normal((n, width))
    if truth["k1"]:  # a sampled k1 (log pi/ref): either sign per token
        v = kl[:, None] + z
    elif truth["tail"] is not None:  # 1% of the tokens carry nearly all of the KL
        v = np.exp(math.log(1e-4) + 0.5 * z)
        k = np.maximum(1, tokens // 100)
        top = np.arange(width)[None, :] < k[:, None]
        v = np.where(top, np.exp(np.log(np.maximum(kl, 1e-12) * tokens / k)[:, None] + 0.3 * z), v)
    else:
        sg = truth["sigma"]
        v = np.exp((np.log(np.maximum(kl, 1e-12)) - sg * sg / 2)[:, None] + sg * z)
    v[kl <= 0] = 0.0 if not truth["k1"] else v[kl <= 0]
    v[0] = 0.0  # step 0: the policy is the reference
    return np.where(np.arange(width)[None, :] < tokens[:, None], v, np.inf)


def _stats(v: np.ndarray, tokens: np.ndarray) -> dict:
    """mean, p50/p90/p99 (numpy's linear interpolation), max and top-1% share of each row's first
    `tokens` values (v sorted per row, +inf beyond)."""
    v = np.sort(v, axis=1)
    rows = np.arange(len(v))
    out = {}
    for q in (0.5, 0.9, 0.99):
        pos = q * (tokens - 1)
        lo = np.floor(pos).astype(int)
        hi = np.minimum(lo + 1, tokens - 1)
        out[q] = v[rows, lo] + (pos - lo) * (v[rows, hi] - v[rows, lo])
    fin = np.where(np.isfinite(v), v, 0.0)
    pos_part = np.clip(fin, 0, None)
    csum = np.cumsum(pos_part, axis=1)
    k = np.ceil(0.01 * tokens).astype(int)
    total = csum[rows, tokens - 1]
    top = total - np.where(tokens - k - 1 >= 0, csum[rows, np.maximum(tokens - k - 1, 0)], 0.0)
    out["share"] = np.where(total > 0, top / np.where(total > 0, total, 1.0), 0.0)
    out["mean"] = fin.sum(axis=1) / tokens
    out["max"] = v[rows, tokens - 1]
    return out


def sample(rng: np.random.Generator, truth: dict, samples: int = SAMPLES) -> list[dict]:
    """The metrics records a trainer would log for these true trajectories (see the module docstring),
    `samples` responses a step."""
    n = len(truth["kl"])
    beta = truth["beta0"] if truth["beta_fixed"] is None else truth["beta_fixed"]
    length = np.maximum(truth["length"] + rng.normal(0, 0.05, n), 1.0)
    tokens = (samples * length).astype(int)
    st = _stats(_kl_tokens(rng, np.asarray(truth["kl"], dtype=float), tokens, truth), tokens)
    wins = rng.binomial(samples, np.clip(truth["reward"], 0, 1)) / samples
    noise = rng.standard_normal((n, 9))
    rows = []
    for i in range(n):
        r, kl_mean = float(wins[i]), float(st["mean"][i])
        e = noise[i]
        rl = float(truth["ratio_log"][i])  # pi/pi_old and log(pi/ref) extremes as measured on the README's job
        kl_i = max(float(truth["kl"][i]), 0.0)
        rows.append({
            "step": i, "reward_mean": r, "reward_std": math.sqrt(r * (1 - r)), "samples": samples,
            "kl_mean": kl_mean, "kl_p50": float(st[0.5][i]), "kl_p90": float(st[0.9][i]), "kl_p99": float(st[0.99][i]),
            "kl_max": float(st["max"][i]), "kl_top1_share": float(st["share"][i]),
            "kl_by_position": [float(x) for x in rng.dirichlet(np.ones(6)) * 6 * kl_mean],
            "beta": beta, "beta_min": truth["beta_min"],
            "entropy": float(truth["entropy"][i] + 0.01 * e[1]), "entropy_max": math.log(VOCAB),
            "repetition_rate": float(max(truth["repetition"][i] + 0.01 * e[2], 0.0)),
            "response_len": float(length[i]), "adv_abs_mean": float(truth["adv"][i] * (1 + 0.03 * e[3])),
            "ratio_min": math.exp(-rl * math.exp(0.6 * e[0])), "ratio_max": math.exp(0.5 * rl * math.exp(0.45 * e[4])),
            "ref_log_ratio_min": -(1.4 + 6.0 * kl_i) * math.exp(0.2 * e[5]),
            "ref_log_ratio_max": 4.4 + 4.5 * kl_i + 1.6 * e[6],
            "grad_norm": float(truth["grad_norm"][i] * math.exp(0.2 * e[7])), "skipped": 0,
            "lr": 1e-4, "pg_loss": float(0.01 * e[8]), "ref_synced": False,
            # the rollout-vs-training mismatch of kltron's default job in bf16 (docs/benchmarks.md)
            "rollout_ratio_out_share": 0.0, "token_mult_prob_error": 1.0 + 2e-4 * (1 + i % 3),
            "rollout_kl_mean": 1e-6, "rollout_logp_diff_max": 0.02})
        if truth["beta_fixed"] is None:  # Ziegler et al.: e = clip(KL/target - 1, +-0.2), 1/horizon per step
            err = min(max(kl_mean / truth["target"] - 1, -0.2), 0.2)
            beta = min(max(beta * (1 + err / truth["horizon_steps"]), truth["beta_min"]), 1.0)
    return rows


def _ramp(n: int, start: int, a: float, b: float, end: int | None = None) -> np.ndarray:
    """a until `start`, then linearly to b at `end` (default: the last step), b after."""
    t = np.arange(n, dtype=float)
    end = n - 1 if end is None else end
    return np.where(t < start, a, a + (b - a) * np.clip((t - start) / max(end - start, 1), 0, 1))


def _with_startup(kl: np.ndarray) -> np.ndarray:
    t = np.arange(len(kl), dtype=float)
    return kl * np.minimum(t / 6, 1.0)


def fault(name: str, rng: np.random.Generator) -> list[dict]:
    """One faulty run showing symptom `name` (a key of FAULTS)."""
    n = FAULTS[name][0]
    truth = healthy_truth(rng, n)
    FAULTS[name][1](truth, n, rng)
    rows = sample(rng, truth)
    if len(FAULTS[name]) > 2:
        FAULTS[name][2](rows)
    return rows


def _set(**kw):
    def f(truth, n, rng):
        for k, v in kw.items():
            truth[k] = v(n) if callable(v) else v
    return f


def _nan_strings(rows):
    rows[30]["grad_norm"] = "nan"
    rows[31]["kl_mean"] = "NaN"
    rows[32]["pg_loss"] = "inf"


def _bf16_mismatch(rows):
    """From step 20 a rollout that samples another distribution, as the peers' bf16 stacks: 5-10% of the
    tokens outside [0.9, 1.1] (verl #6280, TRL #6789), NeMo-RL's error ~1.03."""
    for i, r in enumerate(rows[20:]):
        r.update(rollout_ratio_out_share=0.05 + 0.05 * (i % 2), token_mult_prob_error=1.03 + 0.005 * (i % 3),
                 rollout_kl_mean=2e-3, rollout_logp_diff_max=0.9)


def _grad_zero(rows):
    for r in rows[10:]:
        r["grad_norm"] = 0.0


def _adv_spikes(rows):
    for s in (60, 75, 90):
        rows[s]["adv_abs_mean"] *= 6.0
        for r in rows[s + 1:s + 3]:
            r["kl_mean"] += 1.5


def _recipe_keys(key, start, end, noise, **const):
    """Records gain `key` ramping from `start` to `end` over the run (deterministic +-noise wiggle) and `const`."""
    def f(rows):
        n = len(rows)
        for i, r in enumerate(rows):
            r[key] = start + (end - start) * i / max(n - 1, 1) + noise * math.sin(1.7 * i)
            r.update(const)
    return f


# symptom -> (steps, change to the healthy truth[, change to the sampled records])
FAULTS = {
    # a steady KL rise below 1 nat: 0.1 at step 10 -> 0.9 at step 110 under a fixed beta
    "kl_climbing": (110, _set(kl=lambda n: _with_startup(_ramp(n, 10, 0.1, 0.9))),
                    lambda rows: [r.update(beta=0.02) for r in rows]),
    # the KL soars (x2 every ~7 steps to ~5 nats) while the reward climbs to 0.9; beta shrinking
    "reward_hacking": (90, _set(kl=lambda n: _with_startup(0.15 * np.exp(np.clip(np.arange(n) - 60, 0, None) / 10)),
                                reward=lambda n: _ramp(n, 60, 0.35, 0.9))),
    "kl_high": (80, _set(kl=lambda n: _with_startup(np.full(n, 2.0)))),
    "kl_flat_reward": (100, _set(kl=lambda n: _with_startup(np.full(n, 0.003)), reward=lambda n: np.full(n, 0.3),
                                 adv=lambda n: np.full(n, 0.05))),
    "reward_flat_kl_normal": (150, _set(reward=lambda n: np.full(n, 0.31))),
    "ref_follows_policy": (100, _set(kl=lambda n: _with_startup(np.full(n, 2e-4)))),
    "kl_negative": (60, _set(kl=lambda n: _with_startup(np.full(n, -0.05)), k1=True)),
    "kl_adv_spike": (100, _set(), _adv_spikes),
    "rollout_mismatch": (60, _set(), _bf16_mismatch),
    "non_finite": (60, _set(), _nan_strings),
    "collapse": (40, _set(), _grad_zero),
    "entropy_collapse": (80, _set(entropy=lambda n: _ramp(n, 40, 0.9, 0.01, 60))),
    "entropy_max": (60, _set(entropy=lambda n: _ramp(n, 30, 0.9, 0.88 * math.log(VOCAB), 35))),
    "beta_zero": (60, _set(beta_fixed=0.0, beta_min=0.0)),
    # the KL stays far under a target of 3: the controller lowers beta x0.8 a step to its floor
    "beta_floor": (80, _set(target=3.0, horizon_steps=1.0)),
    "ratio_extreme": (60, _set(ratio_log=lambda n: _ramp(n, 30, 0.8, 8.0, 35))),
    # the policy samples tokens the reference gives 1e-7 of their probability: pi/ref ~ e^16
    "ref_ratio_extreme": (60, _set(), lambda rows: [r.update(ref_log_ratio_max=16.0 + r["ref_log_ratio_max"] - 5)
                                                    for r in rows[30:]]),
    "repetition_kl_not_high": (80, _set(repetition=lambda n: _ramp(n, 30, 0.02, 0.6, 45))),
    "kl_concentrated": (60, _set(tail=True, kl=lambda n: _with_startup(np.full(n, 0.05)))),
    "response_length_growing": (120, _set(length=lambda n: _ramp(n, 10, 4.0, 12.0))),
    "response_length_shrinking": (120, _set(length=lambda n: _ramp(n, 10, 8.0, 3.0))),
    # dynamic sampling drops 20% of groups at first, 80% by the end (a saturating task)
    "groups_saturating": (100, _set(), _recipe_keys("ds_drop_rate", 0.2, 0.8, 0.03, ds_filled=0,
                                                    ds_extra_rollout_s=0.5)),
    "groups_short": (60, _set(), _recipe_keys("ds_filled", 2.0, 2.0, 0.0, ds_drop_rate=0.3)),
    "seq_clip_high": (60, _set(), _recipe_keys("seq_clipfrac", 0.7, 0.8, 0.02)),
    "overlong_high": (60, _set(), _recipe_keys("overlong_rate", 0.2, 0.3, 0.01)),
    "reward_swings": (60, _set(reward=lambda n: np.clip(0.5 + 0.25 * np.random.default_rng(n).standard_normal(n),
                                                       0.02, 0.98))),
}
