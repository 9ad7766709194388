"""Nothing corrupt is loaded: every load hashes the files it opens against the manifest, resume
falls back to the newest checkpoint that verifies and says why each newer one was rejected, and
retention never lets a corrupt newer folder push the verified one out.

The corruptions are made by hand on the bytes (a flipped byte, a truncation, a deleted manifest,
a dangling `latest`); the expected outcome is the checkpoint saved before it, compared tensor by
tensor with the parameters the model held when that checkpoint was saved. A property-based fuzz
(hypothesis) applies a few hundred byte flips, truncations, appends and header/JSON edits to the
model, optimizer and state files: each is refused with an error naming the file, and the model
is untouched.
"""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch

import core.ckpt as ck
from core.ckpt import CheckpointError
from core.config import ModelConfig, OptimConfig, SFTConfig, load_config
from core.model import build_model
from core.optim import build_optimizer
from core.sft import train
from parallel.dims import ParallelDims, init_parallel
from tests.dist import REPO

C = dict(vocab_size=37, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=32, max_seq_len=8)
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=0, grad_clip=1.0)
FILES = ("model.safetensors", "model-optim.safetensors", "train_state.json")


def cfg() -> ModelConfig:
    return ModelConfig(**C).validate()


def build(state=None, seed: int = 3):
    c = cfg()
    tp_group = None if state is None else state.tp_group
    dp_group = None if state is None else state.dp_group
    model = build_model(c, tp_group, None, seed=seed)
    return model, build_optimizer(model, OPTIM, c, 10, tp_group, dp_group)


def train_step(model, opt, seed: int) -> None:
    ids = torch.randint(0, C["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(seed))
    model(ids).float().pow(2).mean().backward()
    opt.step()


def snapshot(model, opt) -> dict:
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"{k}/{n}": opt.opt.state[p][k].clone() for n, p in model.named_parameters()
                for k in ("exp_avg", "exp_avg_sq")})
    return out


def save_steps(root: str, steps, state=None, keep_last=None, **kw) -> dict[int, dict]:
    """Train one step before each save; returns {step: snapshot at that save}."""
    model, opt = build(state)
    snaps = {}
    for step in steps:
        train_step(model, opt, step)
        ck.save_train_checkpoint(root, step, state, {"policy": (model, opt)}, extra={"tag": step},
                                 keep_last=keep_last, **kw)
        snaps[step] = snapshot(model, opt)
    return snaps


def flip(path: str, where: str = "data", k: int = 0) -> None:
    """XOR one byte with 0x01: in a safetensors file's data (where="data") or header, else anywhere."""
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        if where == "data":
            pos = 8 + struct.unpack("<Q", raw[:8])[0] + k
        elif where == "json":  # a digit of the step in train_state.json: still valid JSON
            pos = raw.index(b'"step": ') + len(b'"step": ')
        else:
            pos = k
        raw[pos] ^= 0x01
        f.seek(0)
        f.write(raw)


def assert_equal_state(model, opt, snap: dict) -> None:
    got = snapshot(model, opt)
    assert got.keys() == snap.keys()
    for k in snap:
        assert torch.equal(got[k], snap[k]), k


@pytest.mark.parametrize("name", FILES)
def test_flipped_byte_is_refused_and_resume_falls_back(tmp_path, capsys, name):
    root = str(tmp_path)
    snaps = save_steps(root, [1, 2])
    bad = os.path.join(root, "step-00000002", name)
    flip(bad, "json" if name.endswith(".json") else "data", k=5)
    model, opt = build(seed=11)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match=re.escape(bad) + ".*sha256 mismatch"):
        ck.load_train_checkpoint(os.path.join(root, "step-00000002"), None, {"policy": (model, opt)})
    for n, p in model.named_parameters():  # refused before a byte was copied in
        assert torch.equal(p, before[n]), n
    extra = ck.resume_train_checkpoint(root, None, {"policy": (model, opt)})
    assert extra == {"tag": 1, "step": 1}
    assert_equal_state(model, opt, snaps[1])
    err = capsys.readouterr().err
    assert f"resuming from {os.path.join(root, 'step-00000001')} (step 1, hashes verified)" in err
    assert "step-00000002 rejected" in err and bad in err and "sha256 mismatch" in err


def test_no_verify_is_the_escape_hatch(tmp_path):
    root = str(tmp_path)
    save_steps(root, [1])
    flip(os.path.join(root, "step-00000001", "model.safetensors"), k=5)
    model, opt = build(seed=11)
    assert ck.load_train_checkpoint(root, None, {"policy": (model, opt)}, verify=False)["step"] == 1


def test_resume_names_every_rejected_newer_checkpoint(tmp_path, capsys):
    """Step 5: manifest deleted; 4: model file truncated; 3: optimizer byte flipped; `latest`
    dangling. Resume takes step 2 and says why each newer one was not taken."""
    root = str(tmp_path)
    snaps = save_steps(root, [1, 2, 3, 4, 5])
    os.remove(os.path.join(root, "step-00000005", "manifest.json"))
    with open(os.path.join(root, "step-00000004", "model.safetensors"), "r+b") as f:
        f.truncate(100)
    flip(os.path.join(root, "step-00000003", "model-optim.safetensors"), k=9)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step-00000009\n")
    assert ck.find_latest(root) == os.path.join(root, "step-00000003")  # the unverified answer
    model, opt = build(seed=11)
    assert ck.resume_train_checkpoint(root, None, {"policy": (model, opt)})["step"] == 2
    assert_equal_state(model, opt, snaps[2])
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0].startswith(f"kltron.checkpoint: resuming from {os.path.join(root, 'step-00000002')}")
    assert "'step-00000009', which is not a checkpoint folder (dangling)" in lines[1]
    assert lines[2].strip().startswith("step-00000005 rejected") and "no manifest.json" in lines[2]
    assert lines[3].strip().startswith("step-00000004 rejected") and "truncated" in lines[3]
    assert lines[4].strip().startswith("step-00000003 rejected") and "model-optim.safetensors" in lines[4]


def test_resume_refuses_when_nothing_verifies(tmp_path):
    root = str(tmp_path)
    save_steps(root, [1])
    flip(os.path.join(root, "step-00000001", "model.safetensors"), k=1)
    model, opt = build()
    with pytest.raises(CheckpointError, match="(?s)no checkpoint to resume from verifies.*step-00000001 rejected"):
        ck.resume_train_checkpoint(root, None, {"policy": (model, opt)})
    assert ck.resume_train_checkpoint(str(tmp_path / "empty"), None, {"policy": (model, opt)}) is None


def test_retention_keeps_the_newest_verified(tmp_path, capsys):
    """A corrupt step 5 made resume fall back to step 2; the run saves step 3 with keep_last=2.
    Step 5 (later than the new save) neither counts nor is deleted: step 2 survives with 3."""
    root = str(tmp_path)
    save_steps(root, [1, 2, 5], keep_last=None)
    flip(os.path.join(root, "step-00000005", "model.safetensors"), k=3)
    model, opt = build(seed=11)
    assert ck.resume_train_checkpoint(root, None, {"policy": (model, opt)})["step"] == 2
    train_step(model, opt, 3)
    ck.save_train_checkpoint(root, 3, None, {"policy": (model, opt)}, keep_last=2)
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == [
        "step-00000002", "step-00000003", "step-00000005"]
    for name in ("step-00000002", "step-00000003"):
        ck.verify_checkpoint(os.path.join(root, name))
    assert "retention leaves ['step-00000005']" in capsys.readouterr().err


@pytest.mark.slow
def test_sft_entry_point_resumes_from_the_newest_verified(tmp_path, capsys):
    """core.sft: a run stopped at step 4 (checkpoints 2 and 4), step 4's optimizer file corrupted;
    the same command resumes from step 2 and its losses equal a straight run's steps 3..6."""
    tiny = os.path.join(REPO, "configs", "sft_tiny.yaml")
    fast = ["model.hidden_size=32", "model.intermediate_size=64", "data.seq_len=32", "optim.warmup_steps=3",
            "optim.lr=5e-3", "train.progress=false"]
    straight = train(load_config(SFTConfig, tiny, fast + ["train.steps=6", f"train.out_dir={tmp_path / 'a'}"]))
    args = fast + ["train.steps=6", "train.save_every=2", f"train.out_dir={tmp_path / 'b'}"]
    train(load_config(SFTConfig, tiny, args + ["train.stop_after=4"]))
    bad = os.path.join(tmp_path, "b", "checkpoints", "step-00000004", "model-optim.safetensors")
    flip(bad, k=7)
    capsys.readouterr()
    resumed = train(load_config(SFTConfig, tiny, args))
    assert resumed["losses"] == straight["losses"][2:]
    err = capsys.readouterr().err
    assert "resuming from" in err and "step-00000002 (step 2, hashes verified)" in err
    assert "step-00000004 rejected" in err and bad in err
    for name in os.listdir(tmp_path / "b" / "checkpoints"):
        if name.startswith("step-"):
            ck.verify_checkpoint(str(tmp_path / "b" / "checkpoints" / name))


# ---------------------------------------------------------------------------------------------
# two gloo ranks: the hashing is split, the error is raised on every rank, resume agrees


def _two_rank_resume(root: str) -> dict:
    state = init_parallel(ParallelDims(2, 1), "cpu", C["n_heads"], C["n_kv_heads"])
    calls = []
    real = ck.manifest.sha256_file

    def counting(path):
        calls.append(os.path.basename(path))
        return real(path)

    ck.manifest.sha256_file = counting
    try:
        model, opt = build(state, seed=11)
        try:
            ck.load_train_checkpoint(os.path.join(root, "step-00000002"), state, {"policy": (model, opt)})
            err = None
        except CheckpointError as e:
            err = str(e)
        calls_bad = sorted(calls)
        calls.clear()
        extra = ck.resume_train_checkpoint(root, state, {"policy": (model, opt)})
        return {"err": err, "calls_bad": calls_bad, "extra": extra, "snap": snapshot(model, opt)}
    finally:
        ck.manifest.sha256_file = real


@pytest.mark.slow
def test_two_ranks_refuse_together_and_split_the_hashing(dist_pools, tmp_path):
    root = str(tmp_path)
    snaps = save_steps(root, [1, 2])  # saved by one process; the layout does not matter on disk
    bad = os.path.join(root, "step-00000002", "model-optim.safetensors")
    flip(bad, k=2)
    res = dist_pools.run(2, _two_rank_resume, root)
    assert res[0]["err"] == res[1]["err"] and bad in res[0]["err"] and "sha256 mismatch" in res[0]["err"]
    # each file hashed by exactly one rank: the folder is read once for hashing, not once per rank
    assert sorted(res[0]["calls_bad"] + res[1]["calls_bad"]) == sorted(FILES)
    assert res[0]["calls_bad"] and res[1]["calls_bad"]
    for r in res:
        assert r["extra"] == {"tag": 1, "step": 1}
        for k, v in snaps[1].items():
            assert torch.equal(r["snap"][k], v), k


# ---------------------------------------------------------------------------------------------
# property-based fuzz


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Two saved train checkpoints: one file per tensor set, and shards plus an index."""
    d = tmp_path_factory.mktemp("fuzz")
    save_steps(str(d / "single"), [1])
    save_steps(str(d / "sharded"), [1], max_shard_bytes=2048)
    out = {}
    for kind in ("single", "sharded"):
        folder = str(d / kind / "step-00000001")
        out[kind] = (folder, sorted(json.load(open(os.path.join(folder, "manifest.json")))["files"]))
    assert any("-of-" in f for f in out["sharded"][1]) and any(f.endswith("index.json") for f in out["sharded"][1])
    return out


def mutate(raw: bytes, kind: str, pos: int, value: int) -> bytes:
    """A different byte string: flip, truncate, append, or edit inside the header / JSON text."""
    b = bytearray(raw)
    if kind == "flip":
        b[pos % len(b)] ^= value or 1
    elif kind == "truncate":
        del b[pos % len(b):]
    elif kind == "append":
        b += bytes([value])
    else:  # "edit": a printable character changed inside the JSON (a safetensors header or a .json file)
        start, end = (0, len(b)) if raw[:1] == b"{" else (8, 8 + struct.unpack("<Q", raw[:8])[0])
        i = start + pos % (end - start)
        new = 0x20 + value % 95
        b[i] = new if new != b[i] else (new + 1 - 0x20) % 95 + 0x20
    assert bytes(b) != raw
    return bytes(b)


def test_fuzz_every_corruption_is_refused_by_name(templates):
    """300 cases, single process: each mutates one file of a saved checkpoint, loads, restores it."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    model, opt = build(seed=11)
    train_step(model, opt, 0)
    sentinel = snapshot(model, opt)
    seen = set()

    @hypothesis.settings(max_examples=300, deadline=2000, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(kind=st.sampled_from(["single", "sharded"]), which=st.integers(0, 100),
                      how=st.sampled_from(["flip", "truncate", "append", "edit"]),
                      pos=st.integers(0, 1 << 20), value=st.integers(0, 255))
    def case(kind, which, how, pos, value):
        folder, files = templates[kind]
        name = files[which % len(files)]
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            raw = f.read()
        try:
            with open(path, "wb") as f:
                f.write(mutate(raw, how, pos, value))
            with pytest.raises(CheckpointError) as e:  # a hang would trip the 2 s deadline
                ck.load_train_checkpoint(folder, None, {"policy": (model, opt)})
            assert path in str(e.value), str(e.value)
        finally:
            with open(path, "wb") as f:
                f.write(raw)
        assert_equal_state(model, opt, sentinel)  # nothing was loaded
        seen.add((name.split("-0")[0].split(".")[0], how))

    case()
    for templ in templates.values():  # restored: both still load
        ck.verify_checkpoint(templ[0])
    assert {"model", "model-optim", "train_state"} <= {n for n, _ in seen} and len({h for _, h in seen}) == 4
