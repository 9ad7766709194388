"""`python -m tools.generate` on checkpoints converted from `transformers` stand-ins (Qwen2 and Llama 3
style, random weights, embedding padded past the tokenizer): greedy tokens equal `transformers`
`generate(do_sample=False)` (fp32, CPU, the padded ids suppressed as kltron's sampler never draws them);
--chat prompt ids equal `apply_chat_template(add_generation_prompt=True)`, plain prompt ids equal the HF
tokenizer's; tp=2 under torchrun gives tp=1's tokens, greedy and sampled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist import REPO, free_port
from tests.standin import MODEL_VOCAB, hf_standin
from tools.convert_hf import main as convert_main
from tools.generate import main as generate_main

transformers = pytest.importorskip("transformers")

QUESTIONS = ["What is 12 + 30?", "Ana has 3 apples and buys 4 more. How many apples does she have?"]


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def converted(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf, ck = str(d / "hf"), str(d / "ckpt")
    hf_standin(hf, request.param)
    assert convert_main(["import", "--hf-dir", hf, "--out", ck]) == 0
    return request.param, hf, ck


def _ours(capsys, ck, *extra) -> list[dict]:
    assert generate_main(["--ckpt", ck, "--json", "--device", "cpu", *extra]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _hf_greedy(hf, ids, max_new, vocab):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    eos = set(transformers.GenerationConfig.from_pretrained(hf).eos_token_id)
    with torch.no_grad():
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new, suppress_tokens=list(range(vocab, MODEL_VOCAB)),
                             eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])[0, len(ids):].tolist()
    cut = next((i + 1 for i, t in enumerate(seq) if t in eos), len(seq))  # up to and including the first EOS
    return seq[:cut]


@pytest.mark.parametrize("chat", [True, False])
def test_greedy_matches_transformers(converted, capsys, chat):
    _, hf, ck = converted
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    args = [a for q in QUESTIONS for a in ("--prompt", q)] + ["--max-new-tokens", "12"] + (["--chat"] if chat else [])
    rows = _ours(capsys, ck, *args)
    assert [r["prompt"] for r in rows] == QUESTIONS
    for q, r in zip(QUESTIONS, rows):
        if chat:
            want = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
        else:
            want = tok(q)["input_ids"]  # bos first where the tokenizer adds one (Llama 3)
        assert r["prompt_ids"] == list(want)
        assert r["response_ids"] == _hf_greedy(hf, r["prompt_ids"], 12, len(tok))
        eos = set(transformers.GenerationConfig.from_pretrained(hf).eos_token_id)
        assert r["stop"] == ("eos" if r["response_ids"][-1] in eos else "length")
        body = r["response_ids"][:-1] if r["stop"] == "eos" else r["response_ids"]
        assert r["text"] == tok.decode(body)


def test_system_prompt_and_text_output(converted, capsys):
    _, hf, ck = converted
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    rows = _ours(capsys, ck, "--prompt", "hi", "--chat", "--system", "Be brief.", "--max-new-tokens", "3")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert rows[0]["prompt_ids"] == list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False))
    assert generate_main(["--ckpt", ck, "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_sampling_is_seeded(converted, capsys):
    _, _, ck = converted
    args = ["--prompt", "2 + 2 =", "--temperature", "1.0", "--top-p", "0.9", "--max-new-tokens", "8"]
    a, b = _ours(capsys, ck, *args, "--seed", "3"), _ours(capsys, ck, *args, "--seed", "3")
    c = _ours(capsys, ck, *args, "--seed", "4")
    assert a == b and len(a[0]["response_ids"]) > 0
    assert c[0]["prompt_ids"] == a[0]["prompt_ids"]


def test_errors_are_named(converted, capsys, tmp_path):
    _, _, ck = converted
    assert generate_main(["--ckpt", str(tmp_path), "--prompt", "x"]) == 2
    assert "not a kltron checkpoint" in capsys.readouterr().err
    assert generate_main(["--ckpt", ck, "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err
    assert generate_main(["--ckpt", ck, "--prompt", "x", "--tp", "2"]) == 2
    assert "--tp=2 must equal the number of processes (1)" in capsys.readouterr().err


@pytest.mark.slow  # torchrun, two processes
def test_tp2_gives_tp1_tokens(converted, capsys):
    style, _, ck = converted
    if style != "qwen2":
        pytest.skip("one checkpoint style is enough here: the sharded sampler does not depend on it")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for extra in ([], ["--temperature", "1.0", "--seed", "5"]):
        args = ["--prompt", QUESTIONS[0], "--prompt", "1 2 3", "--chat", "--max-new-tokens", "10", *extra]
        one = _ours(capsys, ck, *args)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--master_port={free_port()}", "-m", "tools.generate", "--ckpt", ck, "--tp", "2", "--json",
               "--device", "cpu", *args]
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stderr[-3000:]
        assert [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")] == one
