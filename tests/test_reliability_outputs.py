"""What a run leaves behind: the final model is verified before a run is called complete (and written
from the last checkpoint when it is not), checkpoints carry the tokenizer, an import never replaces
a trained checkpoint, one run per out_dir (flock), and a replaced prompt file is not resumed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.dist import REPO

CONFIG = os.path.join(REPO, "configs", "grpo_tiny.yaml")
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "init.sft_steps=5", "init.sft_examples=200",
         "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.save_every=0",
         "train.progress=false", "algo.mini_batches=1", "algo.epochs=1"]
# a learning signal from step 0 (as tests/test_reliability_procs.py's divergence test)
PARTIAL = ("reward.task_args={max_operand: 9, ops: '+', partial_credit: 0.5}", "rollout.prompts_per_step=8",
           "rollout.group_size=4", "algo.mini_batches=2", "algo.epochs=2")


def _sha(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    from rl.train import main

    base = tmp_path_factory.mktemp("outputs")
    sft = str(base / "sft")
    assert main(["--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={base / 'first'}",
                 "train.steps=2"]) == 0
    return base, sft


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A start checkpoint trained well below the uniform entropy (the 5-step one is near ln V)."""
    from rl.train import main

    base = tmp_path_factory.mktemp("trained")
    sft = str(base / "sft")
    assert main(_args(sft, base / "first", "init.sft_steps=120", "init.sft_lr=4e-3", "train.steps=1")) == 0
    return base, sft


def _args(sft, out, *extra):
    return ["--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={out}", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["deleted", "flipped_byte"])
def test_a_rerun_writes_a_missing_or_damaged_final_model(sft, damage, capsys):
    """A stop in the last step, or a disk that fills while model/ is written, leaves the last
    checkpoint but no good model/: the rerun says so and writes it (bit for bit the first one), instead
    of "complete; nothing to do"."""
    from core.ckpt import verify_checkpoint
    from rl.train import main

    base, _ = sft
    out = str(base / "first")
    model = os.path.join(out, "model")
    want = _sha(os.path.join(model, "model.safetensors"))
    if damage == "deleted":
        shutil.rmtree(model)
    else:
        with open(os.path.join(model, "model.safetensors"), "r+b") as f:
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([b[0] ^ 1]))
    capsys.readouterr()
    assert main(_args(sft[1], out, "train.steps=2")) == 0
    err = capsys.readouterr().err
    assert "its final model is not there" in err and "nothing to do" not in err, err
    assert verify_checkpoint(model)["step"] == 2
    assert _sha(os.path.join(model, "model.safetensors")) == want
    assert main(_args(sft[1], out, "train.steps=2")) == 0  # now complete: nothing to do
    assert "final model verified" in capsys.readouterr().err


@pytest.mark.slow
def test_training_checkpoints_carry_the_tokenizer_and_export_finds_it(sft, tmp_path):
    from core.ckpt import find_latest, verify_checkpoint
    from tools.convert_hf import main as convert

    base, _ = sft
    step = find_latest(os.path.join(base / "first", "checkpoints"))
    assert "tokenizer.model" in verify_checkpoint(step)["files"]
    assert convert(["export", "--ckpt", step, "--hf-dir", str(tmp_path / "hf")]) == 0
    assert os.path.isfile(tmp_path / "hf" / "tokenizer.model")


def test_export_without_tokenizer_files_warns(tmp_path, capsys):
    from core.ckpt import save_model_weights
    from core.config import ModelConfig
    from core.model import Transformer
    from tools.convert_hf import export_hf

    cfg = ModelConfig(vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=2, intermediate_size=32,
                      max_seq_len=16)
    save_model_weights(Transformer(cfg, None, device="cpu"), str(tmp_path / "ck"), None)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert "holds no tokenizer files" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# tools.convert_hf import --out


def test_import_refuses_to_replace_a_checkpoint(tmp_path, capsys):
    """An existing model folder is refused by name (--force replaces it); a training checkpoint
    (weights and optimizer state) is refused even with --force."""
    pytest.importorskip("transformers")
    from core.ckpt import save_checkpoint_at
    from tests.helpers import make_hf
    from tools.convert_hf import main as convert

    hf = str(tmp_path / "hf")
    make_hf("llama", hf)
    out = str(tmp_path / "model")
    assert convert(["import", "--hf-dir", hf, "--out", out]) == 0
    before = _sha(os.path.join(out, "manifest.json"))
    time.sleep(0.01)
    assert convert(["import", "--hf-dir", hf, "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} already holds a kltron model checkpoint" in err and "--force" in err
    assert _sha(os.path.join(out, "manifest.json")) == before
    assert convert(["import", "--hf-dir", hf, "--out", out, "--force"]) == 0

    step = str(tmp_path / "checkpoints" / "step-00000007")
    save_checkpoint_at(step, 7, lambda tmp: open(os.path.join(tmp, "policy-optim.safetensors"), "wb").write(b"x"),
                       info={"kind": "train", "model_config": {}, "tp": 1, "dtype": "float32",
                             "tokenizer_fingerprint": None})
    for extra in ([], ["--force"]):
        assert convert(["import", "--hf-dir", hf, "--out", step, *extra]) == 2
        assert "holds a kltron train checkpoint of step 7" in capsys.readouterr().err
    assert os.path.isfile(os.path.join(step, "policy-optim.safetensors"))


# ---------------------------------------------------------------------------------------------
# one run per out_dir


def test_a_second_run_in_the_same_folder_is_refused_by_pid_and_host(tmp_path):
    """Two real processes: the second is refused naming the first's pid; once the first is killed
    (SIGKILL: no clean-up ran) its lock does not block the next one."""
    from core.runtime.run import lock_out_dir

    out = str(tmp_path / "run")
    code = ("import sys, time; from core.runtime.run import lock_out_dir; f = lock_out_dir(sys.argv[1]); "
            "print('locked', flush=True); time.sleep(120)")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    holder = subprocess.Popen([sys.executable, "-c", code, out], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"in use by another run \(pid and host: {holder.pid} "):
            lock_out_dir(out)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    lock_out_dir(out).close()  # a dead holder's lock is gone with it


# ---------------------------------------------------------------------------------------------
# prompt data


def test_a_replaced_prompt_file_is_refused_by_name(tmp_path):
    from rl.experience.prompts import PromptDataConfig, PromptDataError, PromptSampler, data_hashes

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    cfg = PromptDataConfig(train_file=str(path), apply_chat_template=False)
    saved = PromptSampler(8, 4, files=data_hashes(cfg)).state_dict()
    assert saved["files"][str(path)] == hashlib.sha256(path.read_bytes()).hexdigest()
    PromptSampler(8, 4, files=data_hashes(cfg)).check_state(saved)  # unchanged: accepted
    path.write_text(path.read_text().replace('"answer": "3"', '"answer": "4"'))  # same count, other content
    with pytest.raises(PromptDataError, match=rf"resume: {path} is not the file this run was trained on"):
        PromptSampler(8, 4, files=data_hashes(cfg)).check_state(saved)
    legacy = {k: v for k, v in saved.items() if k != "files"}  # a checkpoint from before the hash
    PromptSampler(8, 4, files=data_hashes(cfg)).check_state(legacy)


@pytest.mark.parametrize("prompt", ['""', '"   "', '[{"role": "user", "content": ""}]'])
def test_an_empty_prompt_is_refused_at_load_by_file_and_line(tmp_path, prompt):
    from core.tokenizer import load_tokenizer
    from rl.experience.prompts import PromptDataConfig, PromptDataError, load_prompt_set

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n' + f'{{"prompt": {prompt}, "answer": "2"}}\n')
    cfg = PromptDataConfig(train_file=str(path), apply_chat_template=False)
    with pytest.raises(PromptDataError, match=rf"{path}:2: field 'prompt' "):
        load_prompt_set(str(path), cfg, load_tokenizer(None))


# ---------------------------------------------------------------------------------------------
# resuming: changed config, a guard's stop, the reward/KL window


def test_a_changed_config_is_refused_naming_the_keys(tmp_path):
    import yaml

    from core.config import load_config, to_dict
    from core.runtime.run import check_config_unchanged
    from rl.config import RLConfig

    old = load_config(RLConfig, CONFIG, [])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(old), sort_keys=False))
    check_config_unchanged(str(tmp_path), load_config(RLConfig, CONFIG, ["train.steps=999", "parallel.tp=2"]))
    new = load_config(RLConfig, CONFIG, ["optim.lr=0.5", "kl.estimator=k1"])
    with pytest.raises(ValueError, match=r"config differs .*kl.estimator: 'k3\+' -> 'k1'; optim.lr: .* -> 0.5\. "
                                         r"Start a new run .*train.allow_config_change=true"):
        check_config_unchanged(str(tmp_path), new)
    check_config_unchanged(str(tmp_path), load_config(RLConfig, CONFIG, ["optim.lr=0.5",
                                                                         "train.allow_config_change=true"]))


def test_a_run_saved_before_a_key_existed_resumes_with_the_key_at_its_default(tmp_path):
    """An upgrade of kltron adds config keys: a run whose config.yaml lacks them resumes when they stay at
    their defaults, and is refused by name when one is set."""
    import yaml

    from core.config import load_config, to_dict
    from core.runtime.run import check_config_unchanged
    from rl.config import RLConfig

    old = to_dict(load_config(RLConfig, CONFIG, []))
    del old["algo"]["recipe"], old["rollout"]["record_hidden"]  # as an older kltron wrote it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    check_config_unchanged(str(tmp_path), load_config(RLConfig, CONFIG, []))
    with pytest.raises(ValueError, match=r"config differs .*rollout.record_hidden: True -> False"):
        check_config_unchanged(str(tmp_path), load_config(RLConfig, CONFIG, ["rollout.record_hidden=false"]))


def test_keep_last_zero_means_keep_all():
    from core.config import ConfigError, TrainConfig, check_train

    check_train(TrainConfig(keep_last=0))
    with pytest.raises(ConfigError, match="train.keep_last must be a positive integer or 0 .0: keep all"):
        check_train(TrainConfig(keep_last=-1))


def test_a_full_disk_names_the_step_and_folder(tmp_path, monkeypatch):
    import errno

    import core.ckpt.train as ckpt_train
    from core.ckpt import CheckpointError
    from core.config import ModelConfig
    from core.model import Transformer
    from core.runtime.run import Run

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt_train, "write_train_state", full)
    cfg = ModelConfig(vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=2, intermediate_size=32,
                      max_seq_len=16)
    run = Run(None, None, str(tmp_path))
    with pytest.raises(CheckpointError, match=rf"writing the checkpoint of step 7 under {tmp_path}/checkpoints: "
                                              r".*No space left on device; free space there"):
        run.save(7, {"policy": (Transformer(cfg, None, device="cpu"), None)}, {}, None)
    assert not os.path.exists(tmp_path / "checkpoints" / "step-00000007")  # nothing half-written


def test_a_full_disk_in_the_metrics_names_the_file_and_step_and_tears_no_line(tmp_path):
    """The disk fills in the middle of a metrics line: the error names the file and the step (as the
    training loops wrap the write), and the file keeps only whole lines, so `read_metrics` and a
    resume still accept it."""
    import errno

    from core.ckpt import CheckpointError
    from core.runtime.metrics import MetricsWriter, read_metrics
    from core.runtime.run import saving

    path = str(tmp_path / "metrics.jsonl")
    writer = MetricsWriter(path)
    writer.write({"step": 0, "loss": 1.0})
    real = writer._f

    class FillsUp:  # the disk holds 10 more bytes of the next line
        def write(self, text):
            real.write(text[:10])
            real.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(real, name)

    writer._f = FillsUp()
    with pytest.raises(CheckpointError, match=rf"writing the metrics of step 1 \({path}\): .*No space left on device"):
        with saving("the metrics of step 1"):
            writer.write({"step": 1, "loss": 0.5})
    writer.close()
    assert open(path).read().endswith("}\n") and [r["step"] for r in read_metrics(path)] == [0]


def test_generation_config_is_hash_checked(tmp_path):
    from core.ckpt import CheckpointError, load_model_weights, save_model_weights
    from core.config import ModelConfig
    from core.model import Transformer

    cfg = ModelConfig(vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=2, intermediate_size=32,
                      max_seq_len=16)
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [1, 2]}))
    ck = str(tmp_path / "ck")
    save_model_weights(Transformer(cfg, None, device="cpu"), ck, None, extra_files=[str(gen)])
    load_model_weights(Transformer(cfg, None, device="cpu"), ck, None)
    with open(os.path.join(ck, "generation_config.json"), "w") as f:
        f.write(json.dumps({"eos_token_id": [1, 3]}))  # same size, other eos id
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_model_weights(Transformer(cfg, None, device="cpu"), ck, None)


def _warm_start_views(sft_dirs: list[str], start_on: list[int]):
    """On each rank: init.sft_dir is that rank's entry of `sft_dirs` (two folders stand for a file
    system rank 1 does not share); ranks in `start_on` hold a start checkpoint there. -> the error."""
    import torch.distributed as dist

    import rl.warmstart as ws
    from core.config import load_config
    from core.tokenizer import load_tokenizer
    from rl.config import RLConfig

    ws.VISIBLE_GRACE_S = 0.3
    rank = dist.get_rank()
    cfg = load_config(RLConfig, CONFIG, [*SMALL, f"init.sft_dir={sft_dirs[rank]}"])
    if rank in start_on:
        os.makedirs(cfg.init.start_checkpoint, exist_ok=True)
        open(os.path.join(cfg.init.start_checkpoint, "manifest.json"), "w").write("{}")
    try:
        ws.ensure_start_checkpoint(cfg, load_tokenizer(None), "cpu")
    except ws.ckpt.CheckpointError as e:
        return str(e)
    return None


def test_a_rank_that_cannot_see_the_warm_start_files_is_named_at_once(dist_pools, tmp_path):
    """Every rank raises, naming the rank that cannot see rank 0's files, without the SFT running or a
    long wait: first the task corpus rank 0 writes, then a start checkpoint only rank 0 sees."""
    dirs = [str(tmp_path / "shared"), str(tmp_path / "rank1-local")]
    t0 = time.monotonic()
    msgs = dist_pools.run(2, _warm_start_views, dirs, [], timeout=60)
    assert time.monotonic() - t0 < 20
    for d, m in zip(dirs, msgs):  # each rank names the folder its config gives (the same on a real launch)
        assert m is not None and re.search(rf"rank 1 cannot see {d}/task_data.txt, written by rank 0 .*which rank 0 "
                                           rf"sees: init.sft_dir={d} must be on a file system every rank sees", m), m
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    msgs = dist_pools.run(2, _warm_start_views, dirs, [0], timeout=60)
    for d, m in zip(dirs, msgs):
        assert m is not None and re.search(rf"rank 1 cannot see the start checkpoint {d}/model, .*init.sft_dir={d} ",
                                           m), m


@pytest.mark.slow
def test_a_run_the_collapse_guard_stopped_is_not_resumed(trained, capsys):
    from rl.train import main

    base, sft_dir = trained
    out = str(base / "collapsed")
    with pytest.raises(SystemExit, match="learning rate too high"):
        main(_args(sft_dir, out, "train.steps=6", "optim.lr=1e30", *PARTIAL))
    stopped = json.load(open(os.path.join(out, "stopped.json")))
    assert stopped["kind"] == "collapse"
    capsys.readouterr()
    assert main(_args(sft_dir, out, "train.steps=6", "optim.lr=1e30", *PARTIAL)) == 2
    err = capsys.readouterr().err
    assert f"was stopped at step {stopped['step']} by the collapse guard" in err and "stopped.json" in err, err


@pytest.mark.slow
def test_reward_kl_corr_resumes_bitwise(trained):
    from rl.train import main

    base, sft_dir = trained
    rows = {}
    for name, parts in (("straight", [[]]), ("resumed", [["train.stop_after=3"], []])):
        out = str(base / f"corr_{name}")
        for extra in parts:
            assert main(_args(sft_dir, out, "train.steps=6", "optim.lr=3e-3", *PARTIAL, *extra)) == 0
        rows[name] = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    corr = {k: [r.get("reward_kl_corr") for r in v] for k, v in rows.items()}
    assert any(c is not None for c in corr["straight"][3:]), corr
    assert corr["resumed"] == corr["straight"]


@pytest.mark.slow
def test_sigterm_during_the_warm_start_stops_it_promptly(tmp_path):
    """A real SIGTERM to `python -m rl.train` while its supervised warm start runs: it stops at the next
    SFT step with the SFT checkpoint written and exits 0 (it used to finish the whole SFT first)."""
    import signal

    sft = tmp_path / "sft"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "rl.train", "--config", CONFIG, *SMALL, "init.sft_steps=100000",
           f"init.sft_dir={sft}", f"train.out_dir={tmp_path / 'rl'}", "train.steps=2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (os.path.exists(sft / "metrics.jsonl") and os.path.getsize(sft / "metrics.jsonl") > 0):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the warm start logged no step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert "stop requested by signal" in out, out[-3000:]
    assert os.listdir(sft / "checkpoints")
