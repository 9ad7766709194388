"""What a run leaves behind: the final model is verified before a run is called complete (and written
from the last checkpoint when it is not), checkpoints carry the tokenizer, an import never replaces
a trained checkpoint, one run per out_dir (flock), and a replaced prompt file is not resumed."""

from __future__ import annotations

import hashlib
import json
import os
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
    from core.run import lock_out_dir

    out = str(tmp_path / "run")
    code = ("import sys, time; from core.run import lock_out_dir; f = lock_out_dir(sys.argv[1]); "
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
    from rl.prompts import PromptDataConfig, PromptDataError, PromptSampler, data_hashes

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
    from rl.prompts import PromptDataConfig, PromptDataError, load_prompt_set

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n' + f'{{"prompt": {prompt}, "answer": "2"}}\n')
    cfg = PromptDataConfig(train_file=str(path), apply_chat_template=False)
    with pytest.raises(PromptDataError, match=rf"{path}:2: field 'prompt' "):
        load_prompt_set(str(path), cfg, load_tokenizer(None))
