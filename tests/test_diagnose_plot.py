"""tools.diagnose names the symptom that was built into a synthetic run, and nothing on a
healthy one; tools.plot writes its four figures."""

import json
import math
import os

import pytest

from tools.diagnose import diagnose
from tools.diagnose import main as diagnose_main
from tools.plot import plot_run


def _run(n=30, kl=lambda i: 0.05, reward=lambda i: 0.2 + 0.02 * i, beta=lambda i: 0.05, **extra):
    rows = []
    for i in range(n):
        k = kl(i)
        rows.append({"step": i, "kl_mean": k, "kl_p50": k * 0.8, "kl_p90": k * 2, "kl_p99": k * 4,
                     "kl_max": k * 6, "beta": beta(i), "reward_mean": reward(i), "reward_std": 0.1,
                     "grad_norm": 1.0, "skipped": 0, "adv_abs_mean": 0.5, "entropy": 1.0,
                     "kl_by_position": [k] * 4, **{key: f(i) for key, f in extra.items()}})
    return rows


def _names(rows):
    return [f.name for f in diagnose(rows)]


def test_healthy_run_has_no_finding():
    assert _names(_run()) == []


def test_kl_climbing():
    assert _names(_run(kl=lambda i: 0.01 * 1.15 ** i)) == ["kl_climbing"]


def test_kl_leaving_the_reference_at_the_start_is_not_a_climb():
    """The first 12 steps of the README's default GRPO job: the KL rises from exactly 0 (policy = reference)
    to its plateau; a run that keeps climbing after its start-up is still named."""
    start = [0.0, 0.0255, 0.0709, 0.0736, 0.0672, 0.1298, 0.0753, 0.0615, 0.0854, 0.1306, 0.0674, 0.152]
    assert "kl_climbing" not in _names(_run(n=12, kl=lambda i: start[i]))
    assert "kl_climbing" in _names(_run(n=24, kl=lambda i: start[i] if i < 12 else 0.15 * 1.15 ** (i - 11)))


def test_kl_flat_with_flat_reward():
    names = _names(_run(kl=lambda i: 1e-5, reward=lambda i: 0.3, adv_abs_mean=lambda i: 0.0))
    assert names == ["kl_flat_reward"]


def test_non_finite_and_skips():
    rows = _run()
    rows[7]["grad_norm"] = math.nan
    rows[7]["skipped"] = 1
    assert "non_finite" in _names(rows)


def test_low_mean_heavy_tail():
    rows = _run(kl=lambda i: 0.02)
    for r in rows:
        r["kl_max"], r["kl_p99"] = 8.0, 2.0
        r["kl_by_position"] = [0.0, 0.0, 0.0, 0.08]
    assert _names(rows) == ["kl_concentrated"]


def test_heavy_tail_of_a_healthy_run_is_not_concentrated():
    """Per-token KL is heavy-tailed in a healthy run: these are steps of the README's default GRPO job
    (p99 11-19x the mean, max up to 230x; the top 1% carry at most a third of the KL), which the old
    tail-to-mean ratio (p99 > 10x mean) called concentrated."""
    steps = [(0.0781, 0.109, 1.475, 2.92), (0.2186, 0.235, 2.376, 49.7), (0.1589, 0.219, 3.99, 9.58),
             (0.1271, 0.232, 2.02, 8.18)]
    rows = _run(kl=lambda i: steps[i % 4][0])
    for r, (_m, p90, p99, mx) in zip(rows, steps * 8):
        r.update(kl_p90=p90, kl_p99=p99, kl_max=mx, kl_by_position=[0.11, 0.07, 0.01, 0.19, 0.01, 0.73])
    assert "kl_concentrated" not in _names(rows)
    for r in rows:  # the exact share logged by the trainer, as measured on that job (0.26-0.48)
        r["kl_top1_share"] = 0.35
    assert "kl_concentrated" not in _names(rows)
    # the last 20 steps of the 200-step default job (steps 180-199, commit ef15bc9): 8 of them at 0.5-0.77
    late = [0.41, 0.77, 0.35, 0.62, 0.38, 0.57, 0.27, 0.7, 0.41, 0.58, 0.33, 0.75, 0.4, 0.29, 0.6, 0.36, 0.68,
            0.44, 0.31, 0.39]
    for r, share in zip(rows[-20:], late):
        r["kl_top1_share"] = share
    assert "kl_concentrated" not in _names(rows)


def test_kl_on_the_top_percent_of_tokens_is_concentrated():
    """Half of a low mean KL on 1% of the tokens: by the exact logged share, or, in an older metrics
    file without it, as the quantiles prove (the bulk below p99 cannot carry it)."""
    rows = _run(kl=lambda i: 0.05)
    for r in rows:
        r.update(kl_p50=0.001, kl_p90=0.002, kl_p99=0.01, kl_max=12.0)  # 99% of tokens carry <= 0.0099 of 0.05
    assert _names(rows) == ["kl_concentrated"]
    assert "at least 80%" in diagnose(rows)[0].evidence
    for r in rows:
        r["kl_top1_share"] = 0.8
    f = diagnose(rows)
    assert [x.name for x in f] == ["kl_concentrated"] and "80%" in f[0].evidence
    for r in rows:  # a tiny tail (no token a nat from the reference) is not a symptom
        r["kl_max"] = 0.3
    assert _names(rows) == []


def test_reward_swings():
    assert _names(_run(reward=lambda i: 0.5 + (0.3 if i % 2 else -0.3))) == ["reward_swings"]


def test_sampling_noise_is_not_a_swing():
    noisy = dict(samples=lambda i: 256, reward_std=lambda i: 0.5)  # 0/1 rewards: SE of a mean 0.03
    rows = _run(reward=lambda i: 0.5 + (0.03 if i % 2 else -0.03), **noisy)
    assert _names(rows) == []  # +-0.03 is sampling noise
    rows = _run(reward=lambda i: 0.5 + (0.3 if i % 2 else -0.3), **noisy)
    assert _names(rows) == ["reward_swings"]


def test_cli_and_plots(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for r in _run(kl=lambda i: 0.01 * 1.15 ** i):
            f.write(json.dumps(r) + "\n")
    assert diagnose_main([str(run)]) == 0
    assert "[kl_climbing]" in capsys.readouterr().out
    paths = plot_run(_run(), str(run / "plots"))
    assert sorted(os.path.basename(p) for p in paths) == ["kl_beta.png", "kl_heatmap.png", "kl_quantiles.png",
                                                          "reward.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_bad_metrics_file(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    assert diagnose_main([str(tmp_path)]) == 2
    assert "metrics.jsonl:2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        diagnose_main([])
