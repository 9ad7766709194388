"""A real checkpoint end to end, small: a Qwen2-architecture checkpoint saved by `transformers`
(random weights, embedding padded past its byte-level BPE tokenizer with a chat template and two
EOS ids), converted, trained for a few GRPO steps at tp=2 under torchrun on a JSONL of arithmetic
word problems with the math reward, exported, and loaded back by `transformers`, whose greedy
generation (fp32, CPU) must give the same tokens as kltron's."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist import REPO, free_port

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a torchrun job of two processes

from core.tokenizer import DEFAULT_CORPUS, load_tokenizer  # noqa: E402
from tools.convert_hf import main as convert_main  # noqa: E402
from tools.train_tokenizer import train_hf_tokenizer  # noqa: E402

DATA = os.path.join(REPO, "core", "data")
TOK_PIECES, MODEL_VOCAB = 300, 320  # the tokenizer has 303 ids (3 specials); the embedding 320 rows


def _hf_checkpoint(d) -> None:
    """tokenizer files + config.json + model.safetensors in `d`, as a hub Qwen2 checkpoint."""
    train_hf_tokenizer(DEFAULT_CORPUS, str(d), TOK_PIECES, "qwen2")
    gen = (d / "generation_config.json").read_bytes()  # two EOS ids; save_pretrained writes the model's one
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    cfg = transformers.Qwen2Config(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(str(d))
    (d / "generation_config.json").write_bytes(gen)


def _rl_overrides(ckpt: str, out: str) -> list[str]:
    return [f"init.checkpoint={ckpt}", f"train.out_dir={out}", "train.steps=2", "train.save_every=0",
            "train.progress=false", "train.device=cpu", "parallel.tp=2", "parallel.dp=1", "parallel.fsdp=true",
            "reward.task=null", "reward.fns=[math,format]", "reward.combine=weighted", "reward.weights=[1.0,0.1]",
            f"data.train_file={DATA}/arith_word_train.jsonl", f"data.eval_file={DATA}/arith_word_test.jsonl",
            "data.prompt_field=question", "data.answer_field=answer", "data.max_prompt_tokens=160",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
            "rollout.eval_every=1", "rollout.eval_prompts=2", "rollout.eval_k=2",
            "algo.name=grpo", "optim.lr=1e-2", "optim.min_lr=1e-2",
            "optim.warmup_steps=0"]


def _torchrun(args: list[str], timeout: int = 240) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--master_port={free_port()}", "-m", "rl.train", *args]
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:]
    return p.stdout


def _kltron_greedy(model_dir: str, prompts: list[list[int]], max_new: int, vocab_limit):
    from core.ckpt import load_model_weights, read_manifest
    from core.config import ModelConfig, from_dict
    from core.generation.generate import generate
    from core.model import build_model

    cfg = from_dict(ModelConfig, read_manifest(model_dir)["model_config"])
    model = build_model(cfg, seed=0)
    load_model_weights(model, model_dir, None)
    tok = load_tokenizer(model_dir)
    out = []
    for ids in prompts:  # one prompt at a time: no padding on either side
        gen = generate(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=max_new,
                       eos_id=tok.eos_id, eos_ids=tok.eos_ids, pad_id=tok.pad_id, temperature=0.0,
                       vocab_limit=vocab_limit)
        resp = gen.sequences[0, gen.prompt_len:][gen.response_mask[0].bool()].tolist()
        out.append(resp)
    return out


def _hf_greedy(hf_dir: str, prompts: list[list[int]], max_new: int, suppress):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    eos = set(model.generation_config.eos_token_id)
    out = []
    for ids in prompts:
        kw = dict(suppress_tokens=suppress) if suppress else {}
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new, **kw)[0, len(ids):].tolist()
        cut = next((i + 1 for i, t in enumerate(seq) if t in eos), len(seq))  # up to and including the first EOS
        out.append(seq[:cut])
    return out


def test_qwen2_checkpoint_grpo_tp2_export_transformers(tmp_path):
    hf, ck, out, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "run", tmp_path / "back"
    hf.mkdir()
    _hf_checkpoint(hf)
    assert convert_main(["import", "--hf-dir", str(hf), "--out", str(ck)]) == 0
    _torchrun(_rl_overrides(str(ck), str(out)))

    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:  # the held-out eval ran before each step (eval_every=1) on 2 prompts
        assert r["eval_n"] == 2 and 0.0 <= r["eval_pass1"] <= 1.0 and 0.0 <= r["eval_mean_at_k"] <= 1.0
        assert r["reward_mean"] >= 0.0 and r["response_len"] > 0
    model_dir = out / "model"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (model_dir / name).read_bytes() == (hf / name).read_bytes(), name  # carried by the run

    assert convert_main(["export", "--ckpt", str(model_dir), "--hf-dir", str(back)]) == 0
    start = transformers.AutoModelForCausalLM.from_pretrained(str(hf))
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(back))
    assert not torch.equal(start.model.embed_tokens.weight, trained.model.embed_tokens.weight)  # RL moved it

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(back))
    tok = load_tokenizer(str(model_dir))
    assert tok.vocab_size < MODEL_VOCAB
    questions = ["Ana has 3 apples and buys 4 more. How many apples does she have?", "What is 12 + 30?",
                 "A box holds 6 eggs. How many eggs are in 5 boxes?"]
    prompts = []
    for q in questions:
        chat = [{"role": "user", "content": q}]
        ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
        assert ids == tok.encode(tok.render_chat(chat))
        prompts.append(ids)
    padded = list(range(tok.vocab_size, MODEL_VOCAB))  # ids the tokenizer does not have: kltron never samples them
    assert _kltron_greedy(str(model_dir), prompts, 12, tok.vocab_size) == _hf_greedy(str(back), prompts, 12, padded)
    assert _kltron_greedy(str(model_dir), prompts, 12, None) == _hf_greedy(str(back), prompts, 12, None)


def test_data_run_resumes_and_refuses_another_prompt_order(tmp_path, capsys):
    """One process: a data-set run stopped after step 0 resumes at step 1 with the same metrics as an
    uninterrupted run; resuming with another data.seed (another prompt order) is refused by name."""
    from rl.train import main

    hf, ck = tmp_path / "hf", tmp_path / "ckpt"
    hf.mkdir()
    _hf_checkpoint(hf)
    assert convert_main(["import", "--hf-dir", str(hf), "--out", str(ck)]) == 0

    def args(out, *extra):
        ov = [o for o in _rl_overrides(str(ck), str(out)) if not o.startswith(("parallel.", "rollout.eval"))]
        return ["parallel.tp=1", "rollout.eval_every=0", *ov, *extra]

    assert main(args(tmp_path / "straight")) == 0
    assert main(args(tmp_path / "resumed", "train.stop_after=1")) == 0
    capsys.readouterr()
    assert main(args(tmp_path / "resumed", "data.seed=7")) == 2
    assert "prompt order" in capsys.readouterr().err
    assert main(args(tmp_path / "resumed")) == 0
    rows = [[json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")] for d in ("straight", "resumed")]
    keys = ("step", "reward_mean", "kl_mean", "pg_loss", "grad_norm", "entropy")
    assert [{k: r[k] for k in keys} for r in rows[0]] == [{k: r[k] for k in keys} for r in rows[1]]
    assert os.path.isfile(tmp_path / "resumed" / "model" / "tokenizer.json")
