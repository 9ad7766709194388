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
