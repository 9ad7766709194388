"""`rl.train` with LoRA end to end: checkpoints hold the adapters only, and a resumed run equals an
uninterrupted one."""

import os

import pytest

from tests.test_rl_train_cli import CONFIG, KEYS, SMALL, _rows, sft_dir  # noqa: F401 (sft_dir: a fixture)

pytestmark = pytest.mark.slow  # runs the RL entry point on a warm-start checkpoint it first trains

LORA = ["lora.rank=4", "lora.alpha=8", "optim.lr=1e-3", "optim.min_lr=1e-3"]
# a dense reward for runs that must train: the task's exact match can score every sample of the first steps of
# the tiny start checkpoint 0 (it does on an AVX2 CPU), and then no step has a gradient
DENSE = ["reward.use_task_reward=false", "reward.fns=[tests.reward_plugins:digits_over_6]"]


def test_lora_resume_equals_uninterrupted_from_adapter_checkpoints(sft_dir):  # noqa: F811
    from rl.train import main

    base, sft = sft_dir
    straight_out, out = str(base / "lora_straight"), str(base / "lora_resumed")
    flags = ["--config", CONFIG, *SMALL, *LORA, *DENSE, f"init.sft_dir={sft}"]
    assert main([*flags, f"train.out_dir={straight_out}"]) == 0
    common = [*flags, f"train.out_dir={out}"]
    assert main([*common, "train.stop_after=2"]) == 0  # checkpoint at step 1, then the job ends
    ck = os.path.join(out, "checkpoints", "step-00000001")
    assert {"adapters.safetensors", "adapters-optim.safetensors"} <= set(os.listdir(ck))
    assert not any(n.startswith("model") for n in os.listdir(ck))  # the base is the start checkpoint's
    assert main(common) == 0  # resumes at step 2
    straight, resumed = _rows(straight_out), _rows(out)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert straight[3]["grad_norm"] > 0.0
    for a, b in zip(straight, resumed):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}
