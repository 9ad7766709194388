"""Each playbook symptom (tools/symptoms.py) is named on a synthetic run built to show it, and
nothing is named on a healthy one; a real tiny run provoked into a high KL is named too (slow);
TensorBoard event files carry the metrics under their metrics.jsonl names."""

import json
import math
import os

import pytest

from tools.diagnose import diagnose
from tools.plot import plot_run


def _run(n=30, kl=lambda i: 0.05, reward=lambda i: 0.2 + 0.01 * i, beta=lambda i: 0.05, **extra):
    rows = []
    for i in range(n):
        k = kl(i)
        rows.append({"step": i, "kl_mean": k, "kl_p50": k * 0.8, "kl_p90": k * 2, "kl_p99": k * 3,
                     "kl_max": k * 5, "beta": beta(i), "reward_mean": reward(i), "reward_std": 0.3,
                     "samples": 256, "grad_norm": 1.0, "skipped": 0, "adv_abs_mean": 0.8, "entropy": 1.0,
                     "entropy_max": math.log(256), "repetition_rate": 0.02, "kl_by_position": [k] * 4,
                     **{key: f(i) for key, f in extra.items()}})
    return rows


def _names(rows):
    return [f.name for f in diagnose(rows)]


def test_healthy_run_is_quiet():
    assert _names(_run()) == []


def test_reward_flat_while_kl_normal():
    assert _names(_run(reward=lambda i: 0.3, kl=lambda i: 0.05, beta=lambda i: 2.0)) == ["reward_flat_kl_normal"]


def test_kl_level_high_but_flat():
    assert _names(_run(kl=lambda i: 2.0 + 0.01 * (i % 2))) == ["kl_high"]


def test_reward_hacking():
    rows = _run(reward=lambda i: 0.2 + 0.02 * i, kl=lambda i: 0.05 * 1.1 ** i, beta=lambda i: 0.05 * 0.97 ** i)
    assert "reward_hacking" in _names(rows)


def test_entropy_collapse_and_maximum():
    assert _names(_run(entropy=lambda i: 0.01)) == ["entropy_collapse"]
    assert _names(_run(entropy=lambda i: 1.0 if i < 22 else 0.2)) == ["entropy_collapse"]
    assert _names(_run(entropy=lambda i: 5.3)) == ["entropy_max"]


def test_kl_spikes_with_the_advantages():
    spike = {10, 20, 25}
    rows = _run(kl=lambda i: 0.8 if i in spike else 0.05 + 0.001 * (i % 3),
                adv_abs_mean=lambda i: 3.0 if i in spike else 0.8 + 0.01 * (i % 2))
    assert _names(rows) == ["kl_adv_spike"]
    # the same KL spikes with calm advantages: not this symptom
    assert "kl_adv_spike" not in _names(_run(kl=lambda i: 0.8 if i in spike else 0.05 + 0.001 * (i % 3)))


def test_kl_jumps_after_an_advantage_spike_and_stays():
    """A batch of outlier advantages kicks the policy: the KL jumps one or two steps later (momentum) and
    stays up; an advantage spike the KL does not answer is not this symptom."""
    for lag in (1, 2):
        rows = _run(kl=lambda i, lag=lag: 0.05 + 0.002 * (i % 3) if i < 20 + lag else 1.5 + 0.01 * (i % 2),
                    adv_abs_mean=lambda i: 8.0 if i == 20 else 0.3 + 0.01 * (i % 2))
        found = [f for f in diagnose(rows) if f.name == "kl_adv_spike"]
        assert found and f"at steps [{20 + lag}]" in found[0].evidence, lag
    rows = _run(kl=lambda i: 0.05 + 0.002 * (i % 3) if i < 24 else 1.5, adv_abs_mean=lambda i: 8.0 if i == 20 else 0.3)
    assert "kl_adv_spike" not in _names(rows)  # three steps later: not driven by that batch
    assert "kl_adv_spike" not in _names(_run(adv_abs_mean=lambda i: 8.0 if i == 20 else 0.3))


def test_repetition_while_kl_low():
    assert _names(_run(kl=lambda i: 0.01, repetition_rate=lambda i: 0.5)) == ["repetition_low_kl"]
    assert _names(_run(kl=lambda i: 0.5, repetition_rate=lambda i: 0.5)) == []  # repetition the KL reports


def test_plot_draws_reward_kl_correlation(tmp_path):
    rows = _run(reward_kl_corr=lambda i: 0.1 * (i % 5))
    paths = plot_run(rows, str(tmp_path))
    assert os.path.join(str(tmp_path), "reward_kl_corr.png") in paths


def test_tensorboard_events_carry_the_metric_names(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from core.runtime.monitor import Monitor

    mon = Monitor(str(tmp_path), tensorboard=True)
    rows = _run(n=3, reward_kl_corr=lambda i: 0.5)
    for r in rows:
        mon.log(r, r["step"])
    mon.close()
    ea = EventAccumulator(os.path.join(str(tmp_path), "tensorboard"))
    ea.Reload()
    tags = ea.Tags()
    assert {"kl_mean", "reward_mean", "beta", "reward_kl_corr"} <= set(tags["scalars"])
    assert [e.value for e in ea.Scalars("reward_mean")] == pytest.approx([r["reward_mean"] for r in rows])
    assert {"kl_quantiles", "kl_by_position"} <= set(tags["histograms"])


def _real_run(tmp_path, overrides, steps):
    from core.config import load_config
    from rl.config import RLConfig
    from rl.train import run as rl_run

    sft = os.environ.get("KLTRON_TINY_SFT", "runs/tiny_sft")  # the README job's start checkpoint (built if absent)
    cfg = load_config(RLConfig, "configs/grpo_tiny.yaml",
                      [f"init.sft_dir={sft}", f"train.out_dir={tmp_path}", f"train.steps={steps}",
                       "train.progress=false", "rollout.prompts_per_step=8", "rollout.group_size=4",
                       "kl_ctl.horizon=640", "train.save_every=0"] + overrides)
    try:
        rl_run(cfg)
    except SystemExit as e:  # a guard (KL limit, collapse: rl/health/guards.py) stopped it after writing its metrics
        assert "stopping after this checkpoint" in str(e), e
    with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_real_run_beta_zero_high_lr_has_a_high_kl(tmp_path):
    """beta 0 and a learning rate 100x the default: the KL level is named (kl_high), not only 'climbing'."""
    rows = _real_run(tmp_path, ["kl_ctl.mode=fixed", "kl_ctl.beta=0", "kl_ctl.beta_min=0", "optim.lr=1e-2",
                                "optim.min_lr=1e-2"], 10)
    assert "kl_high" in [f.name for f in diagnose(rows, window=6)]


def _playbook_names(rows, window):
    from tools.symptoms import CHECKS

    return [f.name for f in (c(rows, window) for c in CHECKS) if f is not None]


@pytest.mark.slow
@pytest.mark.parametrize("coef,name", [(-1.0, "entropy_collapse"), (2.0, "entropy_max")])
def test_real_run_entropy_pushed_to_its_ends(tmp_path, coef, name):
    """A negative entropy coefficient with a high lr drives the entropy to 0; a large positive one to log V."""
    rows = _real_run(tmp_path, [f"loss.entropy_coef={coef}", "optim.lr=1e-2", "optim.min_lr=1e-2"], 10)
    # pushed to ln V, the collapse guard may stop the run within 3 steps, before the playbook's window
    # fills; tools.diagnose then names it through the guard's finding ("collapse": entropy at ln V)
    found = _playbook_names(rows, 6) + [f.name for f in diagnose(rows, window=6)]
    assert name in found or (name == "entropy_max" and "collapse" in found), found


@pytest.mark.slow
def test_real_default_job_raises_no_symptom(tmp_path):
    """The README's GRPO job (its own batch size), first 30 steps: tools.diagnose names nothing -- every
    check, the playbook's and the older ones (kl_climbing fired on its start-up rise from KL 0 and
    kl_concentrated on the healthy heavy tail of per-token KL before they were fixed)."""
    from core.config import load_config
    from rl.config import RLConfig
    from rl.train import run as rl_run

    sft = os.environ.get("KLTRON_TINY_SFT", "runs/tiny_sft")
    cfg = load_config(RLConfig, "configs/grpo_tiny.yaml", [f"init.sft_dir={sft}", f"train.out_dir={tmp_path}",
                                                           "train.stop_after=30", "train.progress=false",
                                                           "train.save_every=0"])
    rows = rl_run(cfg)
    assert len(rows) == 30
    for n in (12, 20, 30):  # as diagnosed at any point of the run, not only at its end
        assert [(f.name, f.evidence) for f in diagnose(rows[:n])] == [], n


JUMP = {"calls": 0, "per_step": 256, "steps": (9,), "scale": 30.0}
_TASK = []


def jumping_reward(meta, response):
    """The task's exact-match reward, its scale jumping x30 on the steps in JUMP["steps"] (counted by calls:
    prompts x group per step, one process): an outlier batch the policy cannot aim at."""
    if not _TASK:
        from rl.experience.tasks import make_task

        _TASK.append(make_task("arithmetic", max_operand=9, ops="+", partial_credit=0.0))
    step = JUMP["calls"] // JUMP["per_step"]
    JUMP["calls"] += 1
    return _TASK[0].reward(meta, response) * (JUMP["scale"] if step in JUMP["steps"] else 1.0)


@pytest.mark.slow
def test_real_run_reward_scale_jump_kicks_the_kl(tmp_path):
    """The README's GRPO job with the reward's scale jumping x30 at step 9, advantages not divided by the
    group std, no gradient clipping and an optimizer whose step scales with the gradient (AdamW with eps 1
    >> sqrt(v) is SGD with momentum): the outlier batch's update kicks the policy and the KL jumps right
    after the advantages spike. (With the default AdamW and grad_clip=1 the same jump leaves the KL alone:
    the step size is normalised.)"""
    JUMP["calls"] = 0
    rows = _real_run(tmp_path, ["rollout.prompts_per_step=32", "rollout.group_size=8", "kl_ctl.horizon=2560",
                                "reward.use_task_reward=false",
                                "reward.fns=[tests.test_symptoms:jumping_reward]", "algo.adv_std_norm=false",
                                "optim.eps=1.0", "optim.lr=0.03", "optim.min_lr=0.03", "optim.grad_clip=0"], 12)
    rw = [r["reward_mean"] for r in rows]
    assert rw[9] > 5 * max(rw[:9] + rw[10:])  # the plug-in's jump landed on step 9
    found = {f.name: f for f in diagnose(rows)}
    assert "kl_adv_spike" in found, [(f.name, f.evidence) for f in found.values()]
    f = found["kl_adv_spike"]
    assert "at steps [9]" in f.evidence and "outlier rewards" in f.causes and "reward.clip" in f.first_try
