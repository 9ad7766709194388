"""tools/kl_eval against a float64 reference from transformers' logits of the same two random
checkpoints (policy and reference), at tp=1 (in process), tp=2 and dp=2 (gloo ranks) and through
torchrun; bad input names the line, fails on every rank and leaves no R.json."""

from __future__ import annotations

import json
import os

import pytest
import torch

from core.ckpt import CheckpointError
from tests.dist import run_torchrun
from tests.helpers import make_hf
from tools.convert_hf import import_hf
from tools.kl_eval import KLEvalError, evaluate, main

pytest.importorskip("transformers")

SEQS = [(list(range(3, 20)), 5), ([7, 7, 7, 100, 130, 0, 1], 1), ([50] * 30, 29), ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4),
        ([9, 8], 1)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("kl")
    models = {}
    for name, seed in (("policy", 1), ("ref", 2)):
        models[name] = make_hf("llama", str(d / f"{name}_hf"), seed=seed)
        import_hf(str(d / f"{name}_hf"), str(d / name))
    tokens = d / "t.jsonl"
    tokens.write_text("\n".join(json.dumps({"tokens": t, "response_start": k}) for t, k in SEQS) + "\n")
    return str(d), str(tokens), reference(models)


def reference(models) -> list[dict]:
    """Per response token statistics in float64 from transformers' logits."""
    out = []
    for toks, k in SEQS:
        ids = torch.tensor([toks])
        with torch.no_grad():
            lp = torch.log_softmax(models["policy"](ids).logits[0].double(), -1)  # (L, V)
            lq = torch.log_softmax(models["ref"](ids).logits[0].double(), -1)
        pos = torch.arange(k - 1, len(toks) - 1)
        tgt = torch.tensor(toks[k:])
        logp, logq = lp[pos, tgt], lq[pos, tgt]
        p = lp[pos].exp()
        r = logp - logq
        out.append({"logprob": logp, "ref_logprob": logq, "kl_exact": (p * (lp[pos] - lq[pos])).sum(-1),
                    "entropy": -(p * lp[pos]).sum(-1), "k1": r, "k2": 0.5 * r * r, "k3": torch.exp(-r) - 1 + r})
    return out


def check(path, ref):
    doc = json.load(open(path))
    seqs = doc["sequences"]
    assert [s["line"] for s in seqs] == list(range(1, len(SEQS) + 1))
    n = 0
    for s, want in zip(seqs, ref, strict=True):
        for f, w in want.items():
            torch.testing.assert_close(torch.tensor(s[f], dtype=torch.float64), w, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, f=f, s=s: f"line {s['line']} {f}: {m}")
        assert abs(s["sum"]["kl_exact"] - float(want["kl_exact"].sum())) < 1e-3
        n += len(want["k1"])
    summ = doc["summary"]
    assert summ["n_tokens"] == n and summ["n_sequences"] == len(SEQS)
    allk = torch.cat([w["kl_exact"] for w in ref])
    assert abs(summ["kl_exact_mean"] - float(allk.mean())) < 1e-4 and summ["kl_exact_mean"] > 0.1
    assert abs(summ["k3_mean"] - float(torch.cat([w["k3"] for w in ref]).mean())) < 1e-4
    return doc


def test_tp1_in_process(setup, tmp_path):
    d, tokens, ref = setup
    out = str(tmp_path / "r.json")
    assert main(["--policy", f"{d}/policy", "--ref", f"{d}/ref", "--tokens", tokens, "--out", out,
                 "--device", "cpu"]) == 0
    check(out, ref)


def _evaluate(d, tokens, tp, out):
    return evaluate(f"{d}/policy", f"{d}/ref", tokens, tp, out, "cpu")


@pytest.mark.parametrize("tp", [2, 1])  # tp=1 on 2 ranks: dp=2 splits the sequences
def test_two_ranks(dist_pools, setup, tmp_path, tp):
    d, tokens, ref = setup
    out = str(tmp_path / "r.json")
    res = dist_pools.run(2, _evaluate, d, tokens, tp, out)
    assert res[1] is None and res[0]["n_sequences"] == len(SEQS)
    assert check(out, ref)["dp"] == 2 // tp


def test_identical_models_give_zero_kl(setup, tmp_path):
    d, tokens, _ = setup
    out = str(tmp_path / "r.json")
    evaluate(f"{d}/policy", f"{d}/policy", tokens, 1, out, "cpu")
    for s in json.load(open(out))["sequences"]:
        assert all(v == 0.0 for v in s["kl_exact"] + s["k1"] + s["k3"]), s["line"]


BAD = [
    ('{"tokens": [1, 2, 3], "response_start": 1}\n{"tokens": [1, 2, 3], "response_start": 3}\n',
     r"t.jsonl:2: response_start=3 out of range"),
    ('{"tokens": [1, 2, 3], "response_start": 0}\n', r"t.jsonl:1: response_start=0 out of range"),
    ('\n{"tokens": [1, 131], "response_start": 1}\n', r"t.jsonl:2: token id 131 at position 1 is outside the vocab"),
    ('{"tokens": [1, 2], "response_start": 1}\n{"tokens": [1, 2]\n', r"t.jsonl:2: malformed JSON"),
    ('{"tokens": [1, 2]}\n', r"t.jsonl:1: missing key 'response_start'"),
    (json.dumps({"tokens": [1] * 65, "response_start": 1}), r"t.jsonl:1: sequence of 65 tokens exceeds the model's "
                                                            r"max_seq_len=64"),
]


@pytest.mark.parametrize("text,msg", BAD)
def test_bad_input_names_the_line(setup, tmp_path, text, msg):
    d, _, _ = setup
    (tmp_path / "t.jsonl").write_text(text)
    with pytest.raises(KLEvalError, match=msg):
        evaluate(f"{d}/policy", f"{d}/ref", str(tmp_path / "t.jsonl"), 1, str(tmp_path / "r.json"), "cpu")
    assert not os.path.exists(tmp_path / "r.json")


def test_tokenizer_mismatch(setup, tmp_path):
    d, tokens, _ = setup
    m = json.load(open(f"{d}/ref/manifest.json"))
    other = tmp_path / "ref2"
    os.mkdir(other)
    for f in os.listdir(f"{d}/ref"):
        os.link(f"{d}/ref/{f}", other / f)
    os.remove(other / "manifest.json")
    (other / "manifest.json").write_text(json.dumps({**m, "tokenizer_fingerprint": "c" * 64}))
    with pytest.raises(KLEvalError, match=r"tokenizer mismatch \(policy/reference\)"):
        evaluate(f"{d}/policy", str(other), tokens, 1, str(tmp_path / "r.json"), "cpu")


def _evaluate_error(d, tokens, out):
    try:
        _evaluate(d, tokens, 1, out)
    except CheckpointError as e:  # KLEvalError on one rank becomes CheckpointError on all
        return str(e)
    return None


def test_bad_input_fails_on_every_rank(dist_pools, setup, tmp_path):
    d, _, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2, 3], "response_start": 1}\n{"tokens": [1, 2, 3], "response_start": 9}\n')
    errs = dist_pools.run(2, _evaluate_error, d, str(bad), str(tmp_path / "r.json"))
    assert errs[0] == errs[1] and f"{bad}:2: response_start=9" in errs[0]
    assert not os.path.exists(tmp_path / "r.json")


@pytest.mark.slow
def test_torchrun_cli(setup, tmp_path):
    d, tokens, ref = setup
    out = str(tmp_path / "r.json")
    args = ["tools.kl_eval", "--policy", f"{d}/policy", "--ref", f"{d}/ref", "--tp", "2", "--out", out]
    ok = run_torchrun(args + ["--tokens", tokens], nproc=2, timeout=240)
    assert ok.returncode == 0, ok.stderr[-3000:]
    check(out, ref)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2], "response_start": 1}\n{"tokens": [1, 2]\n')
    os.remove(out)
    assert main(["--policy", f"{d}/policy", "--ref", f"{d}/ref", "--tokens", str(bad), "--out", out]) == 2
    assert not os.path.exists(out)


def test_flipped_data_byte_in_a_converted_folder_is_refused(setup, tmp_path, capsys):
    """A converted model.safetensors with one data byte flipped: refused by name (exit 2, no
    R.json); --no-verify is the escape hatch."""
    import shutil
    import struct

    d, tokens, _ = setup
    bad = tmp_path / "policy"
    shutil.copytree(f"{d}/policy", bad)
    with open(bad / "model.safetensors", "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + n + 17)
        byte = f.read(1)[0]
        f.seek(8 + n + 17)
        f.write(bytes([byte ^ 0x04]))
    out = tmp_path / "r.json"
    argv = ["--policy", str(bad), "--ref", f"{d}/ref", "--tokens", tokens, "--out", str(out), "--device", "cpu"]
    assert main(argv) == 2
    assert f"{bad / 'model.safetensors'}: sha256 mismatch" in capsys.readouterr().err
    assert not out.exists()
    assert main(argv + ["--no-verify"]) == 0 and out.exists()
