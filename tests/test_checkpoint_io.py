"""The checkpoint protocol: atomic save, discovery, retention, integrity, validated sliced loading,
and errors raised on every rank."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import core.ckpt as ck
from core.ckpt import CheckpointError
from core.config import ModelConfig, to_dict
from core.shards import full_param_shapes, tp_slice
from tests.dist import REPO

INFO = {"kind": "model", "model_config": {"vocab_size": 131, "hidden_size": 8}, "tp": 1, "dtype": "float32",
        "tokenizer_fingerprint": "ab" * 32}


def _writer(tensors):
    return lambda d: ck.write_tensors(d, tensors)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randn(4, generator=g)}


def _save(root, step, keep_last=None, seed=None):
    return ck.save_checkpoint_dir(str(root), step, _writer(_tensors(step if seed is None else seed)),
                                  info=INFO, keep_last=keep_last)


def _read_latest_file(root):
    return open(os.path.join(root, "latest")).read().strip()


def test_save_layout_manifest_and_latest(tmp_path):
    path = _save(tmp_path, 7)
    assert path == str(tmp_path / "step-00000007") and _read_latest_file(tmp_path) == "step-00000007"
    m = json.load(open(os.path.join(path, "manifest.json")))
    assert m["format_version"] == 1 and m["step"] == 7 and m["kind"] == "model"
    assert m["model_config"] == INFO["model_config"] and m["tokenizer_fingerprint"] == INFO["tokenizer_fingerprint"]
    data = open(os.path.join(path, "model.safetensors"), "rb").read()
    assert m["files"] == {"model.safetensors": hashlib.sha256(data).hexdigest()}
    assert ck.verify_checkpoint(path)["step"] == 7
    assert ck.find_latest(str(tmp_path)) == path
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp")] == []


def test_retention_keeps_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step-")) == ["step-00000003", "step-00000004"]
    assert ck.find_latest(str(tmp_path)).endswith("step-00000004")


def test_keep_one_preserves_existing_until_new_is_complete(tmp_path):
    _save(tmp_path, 1, keep_last=1)
    seen = {}

    def writer(d):
        seen["latest"] = ck.find_latest(str(tmp_path))
        seen["step1_ok"] = os.path.isfile(tmp_path / "step-00000001" / "manifest.json")
        ck.write_tensors(d, _tensors(2))

    ck.save_checkpoint_dir(str(tmp_path), 2, writer, info=INFO, keep_last=1)
    assert seen == {"latest": str(tmp_path / "step-00000001"), "step1_ok": True}
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step-")) == ["step-00000002"]


def test_failed_writer_leaves_previous_checkpoint(tmp_path):
    _save(tmp_path, 1, keep_last=1)

    def writer(d):
        ck.write_tensors(d, _tensors(2))
        raise RuntimeError("disk full")

    with pytest.raises(CheckpointError, match="RuntimeError: disk full"):
        ck.save_checkpoint_dir(str(tmp_path), 2, writer, info=INFO, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001"]
    assert ck.find_latest(str(tmp_path)) == str(tmp_path / "step-00000001")


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 3, seed=0)
    path = _save(tmp_path, 3, seed=1)
    got = ck.read_tensors(path, {"a": (5, 3), "b": (4,)})
    assert torch.equal(got["a"], _tensors(1)["a"])
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000003"]


def test_sha_mismatch_names_the_file(tmp_path):
    path = _save(tmp_path, 1)
    f = os.path.join(path, "model.safetensors")
    data = bytearray(open(f, "rb").read())
    data[-1] ^= 0xFF  # same size: only the hash can tell
    open(f, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 mismatch"):
        ck.verify_checkpoint(path)


def test_find_latest_ignores_incomplete_and_follows_latest(tmp_path):
    root = str(tmp_path)
    assert ck.find_latest(root) is None and ck.find_latest(str(tmp_path / "nope")) is None
    p1, p2 = _save(tmp_path, 1), _save(tmp_path, 2)
    os.makedirs(tmp_path / "step-00000009")  # no manifest: incomplete
    os.makedirs(tmp_path / ".tmp-step-00000010-abcd")
    assert ck.find_latest(root) == p2
    open(tmp_path / "latest", "w").write("step-00000001\n")  # e.g. killed after rename, before latest
    assert ck.find_latest(root) == p1
    open(tmp_path / "latest", "w").write("step-00000009\n")  # points at an incomplete folder
    assert ck.find_latest(root) == p2
    with open(os.path.join(p2, "model.safetensors"), "ab") as f:  # truncated/extended file: size differs
        f.write(b"x")
    assert ck.find_latest(root) == p1


_KILLED_SAVE = """
import os, sys, time, torch
import core.ckpt as ck
root, marker = sys.argv[1], sys.argv[2]
info = {"kind": "model", "model_config": {}, "tp": 1, "dtype": "float32", "tokenizer_fingerprint": None}
def writer(d):
    ck.write_tensors(d, {"a": torch.zeros(5, 3), "b": torch.zeros(4)})
    open(os.path.join(d, "optim.safetensors"), "wb").write(b"half")
    open(marker, "w").write("ready")
    time.sleep(600)
ck.save_checkpoint_dir(root, 2, writer, info=info, keep_last=1)
"""


@pytest.mark.slow
def test_save_killed_halfway_leaves_previous_loadable(tmp_path):
    root = tmp_path / "ckpt"
    p1 = _save(root, 1, keep_last=1)
    marker = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(root), str(marker)], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert proc.poll() is None, "the saving process died early"
            assert time.monotonic() < deadline, "the saving process never reached its writer"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [p for p in os.listdir(root) if p.startswith(".tmp-step-00000002")]  # the half-written folder
    assert _read_latest_file(root) == "step-00000001"
    assert ck.find_latest(str(root)) == p1
    ck.verify_checkpoint(p1)
    assert torch.equal(ck.read_tensors(p1, {"a": (5, 3), "b": (4,)})["a"], _tensors(1)["a"])
    _save(root, 3, keep_last=1)  # the next save removes the stale folder and, now, step 1
    assert sorted(os.listdir(root)) == ["latest", "step-00000003"]


def test_missing_extra_shape_dtype_errors(tmp_path):
    ts = {"a": torch.zeros(5, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    ck.write_tensors(str(tmp_path), ts)
    f = str(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{f}: missing key 'c'"):
        ck.read_tensors(str(tmp_path), {"a": (5, 3), "b": (4,), "c": (1,)})
    with pytest.raises(CheckpointError, match=f"{f}: unexpected key 'b'"):
        ck.read_tensors(str(tmp_path), {"a": (5, 3)})
    assert list(ck.read_tensors(str(tmp_path), {"a": (5, 3)}, strict=False)) == ["a"]
    with pytest.raises(CheckpointError, match=r"key 'a': expected shape \[3, 5\], found \[5, 3\]"):
        ck.read_tensors(str(tmp_path), {"a": (3, 5), "b": (4,)})
    with pytest.raises(CheckpointError, match="key 'b': expected dtype torch.float32, found torch.bfloat16"):
        ck.read_tensors(str(tmp_path), {"a": (5, 3), "b": (4,)}, dtype=torch.float32)
    got = ck.read_tensors(str(tmp_path), {"a": (5, 3), "b": (4,)}, dtype=torch.float32, cast=True)
    assert got["b"].dtype == torch.float32


@pytest.mark.parametrize("tp", [1, 2, 6])  # 6 > n_kv_heads: KV heads replicated; vocab 131 uneven
def test_sliced_reads_match_narrow_and_reassemble(tmp_path, tp):
    cfg = ModelConfig(vocab_size=131, hidden_size=24, n_layers=1, n_heads=6, n_kv_heads=2,
                      intermediate_size=36).validate()
    shapes = full_param_shapes(cfg)
    g = torch.Generator().manual_seed(tp)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    ck.write_tensors(str(tmp_path), full, max_shard_bytes=2048)  # several shards
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    locals_ = [ck.read_tensors(str(tmp_path), shapes, lambda n, s, r=r: tp_slice(n, cfg, r, tp))
               for r in range(tp)]
    for name, t in full.items():
        sl = [tp_slice(name, cfg, r, tp) for r in range(tp)]
        if sl[0].dim is None:
            assert all(torch.equal(loc[name], t) for loc in locals_)
            continue
        for r in range(tp):
            ref = t.narrow(sl[r].dim, sl[r].start, sl[r].stop - sl[r].start)
            got = locals_[r][name]
            assert got.shape[sl[r].dim] == sl[r].local_size
            assert torch.equal(got.narrow(sl[r].dim, 0, ref.shape[sl[r].dim]), ref)
            assert not got.narrow(sl[r].dim, ref.shape[sl[r].dim], sl[r].pad).any()  # zero padding
        if name.startswith(("embed", "lm_head")) or ".wq" in name or "w_" in name:
            whole = torch.cat([locals_[r][name] for r in range(tp)], dim=sl[0].dim)
            assert torch.equal(whole.narrow(sl[0].dim, 0, t.shape[sl[0].dim]), t)
    for name, t in full.items():  # and back: every rank's local pieces give the full tensor again
        sl = [tp_slice(name, cfg, r, tp) for r in range(tp)]
        assert torch.equal(ck.assemble_full([loc[name] for loc in locals_], sl, tuple(t.shape)), t)
    with pytest.raises(ValueError, match="do not cover"):
        ck.assemble_full([torch.zeros(2, 3)], [(0, 0, 2, 2)], (4, 3))


def test_check_config_names_first_differing_field():
    cur = to_dict(ModelConfig())
    saved = json.loads(json.dumps(cur))  # tuples become lists on disk: still equal
    ck.check_config(saved, cur)
    saved["n_kv_heads"] = 4
    with pytest.raises(CheckpointError, match="field 'n_kv_heads' differs: checkpoint has 4, current config has 2"):
        ck.check_config(saved, cur)
    ck.check_config(saved, cur, ignore=("n_kv_heads",))
    with pytest.raises(CheckpointError, match=r"'rope_scaling.factor' differs: checkpoint has 8.0, .* 4.0"):
        ck.check_config({"rope_scaling": {"factor": 8.0}}, {"rope_scaling": {"factor": 4.0}})
    with pytest.raises(CheckpointError, match="'qkv_bias' differs: checkpoint has '<absent>'"):
        ck.check_config({}, {"qkv_bias": True})


def test_check_tokenizer():
    ck.check_tokenizer("a" * 64, "a" * 64)
    with pytest.raises(CheckpointError, match=r"tokenizer mismatch \(reference\): .*aaaa.*bbbb"):
        ck.check_tokenizer("a" * 64, "b" * 64, what="reference")
    with pytest.raises(CheckpointError, match="checkpoint records no fingerprint"):
        ck.check_tokenizer(None, "b" * 64)
    ck.check_tokenizer(None, "b" * 64, allow_missing=True)


def test_bad_manifest_and_info(tmp_path):
    with pytest.raises(CheckpointError, match="info lacks"):
        ck.save_checkpoint_dir(str(tmp_path), 1, lambda d: None, info={"kind": "model"})
    path = _save(tmp_path, 1)
    m = json.load(open(os.path.join(path, "manifest.json")))
    m["format_version"] = 99
    json.dump(m, open(os.path.join(path, "manifest.json"), "w"))
    with pytest.raises(CheckpointError, match="format_version 99 is not supported"):
        ck.verify_checkpoint(path)
    assert ck.find_latest(str(tmp_path)) is None


def test_train_state_and_rng_round_trip(tmp_path):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    rng = ck.capture_rng_states()
    expect = (torch.rand(3), random.random(), np.random.rand())
    state = {"step": 12, "schedule": {"lr": 1e-4}, "rng": rng, "data": {"epoch": 1, "pos": 40},
             "extra": {"kl_controller": {"beta": 0.05}}}
    ck.write_train_state(str(tmp_path), state)
    text = open(tmp_path / "train_state.json").read()
    assert "pickle" not in text and json.loads(text) == state
    got = ck.read_train_state(str(tmp_path))
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    ck.restore_rng_states(got["rng"])
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1] and np.random.rand() == expect[2]
    with pytest.raises(CheckpointError, match="unknown keys"):
        ck.write_train_state(str(tmp_path), {"step": 1, "controller": {}})
    with pytest.raises(CheckpointError, match="not plain JSON"):
        ck.write_train_state(str(tmp_path), {"step": 1, "extra": {"x": float("nan")}})


# ---------------------------------------------------------------------------------------------
# two real gloo ranks


def _dist_save_and_fail(root):
    import torch.distributed as dist

    g = dist.group.WORLD
    rank = dist.get_rank()
    calls = []

    def writer(d):
        calls.append(rank)
        ck.write_tensors(d, _tensors(1))

    path = ck.save_checkpoint_dir(root, 1, writer, info=INFO, keep_last=1, group=g)
    out = {"path": path, "wrote": calls}
    expected = {"a": (5, 3), "b": (4,)}
    if rank == 1:
        expected["zz"] = (2,)  # only rank 1 asks for a key the file lacks
    try:
        ck.load_tensors(path, expected, group=g)
    except CheckpointError as e:
        out["load_error"] = str(e)
    try:
        ck.save_checkpoint_dir(root, 2, lambda d: 1 / 0, info=INFO, keep_last=1, group=g)
    except CheckpointError as e:
        out["save_error"] = str(e)
    dist.barrier()
    if rank == 0:  # corrupt the file, then only rank 0 verifies
        f = os.path.join(path, "model.safetensors")
        data = bytearray(open(f, "rb").read())
        data[-1] ^= 1
        open(f, "wb").write(bytes(data))
    try:
        ck.raise_on_all_ranks(lambda: ck.verify_checkpoint(path), g, src=0)
    except CheckpointError as e:
        out["verify_error"] = str(e)
    out["manifest_step"] = ck.raise_on_all_ranks(lambda: ck.read_manifest(path)["step"], g, src=0)
    return out


def test_errors_raised_on_every_rank(dist_pools, tmp_path):
    root = str(tmp_path / "ckpt")
    r0, r1 = dist_pools.run(2, _dist_save_and_fail, root, timeout=120)
    assert r0["path"] == r1["path"] == os.path.join(root, "step-00000001")
    assert r0["wrote"] == [0] and r1["wrote"] == []  # one writer
    assert r0["load_error"] == r1["load_error"]
    assert "missing key 'zz'" in r0["load_error"] and "rank 1" in r0["load_error"]
    assert r0["save_error"] == r1["save_error"] and "ZeroDivisionError" in r0["save_error"]
    assert r0["verify_error"] == r1["verify_error"] and "model.safetensors: sha256 mismatch" in r0["verify_error"]
    assert r0["manifest_step"] == r1["manifest_step"] == 1
    assert sorted(os.listdir(root)) == ["latest", "step-00000001"]  # the failed save left nothing
