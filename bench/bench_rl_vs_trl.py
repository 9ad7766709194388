"""One GRPO step of kltron against TRL's GRPOTrainer, side by side, on the same weights, tokenizer,
prompts and work; and generation alone against transformers' `generate`. fp32, CPU, one process.

    python -m bench.bench_rl_vs_trl [--sizes tiny,60m] [--steps 3] [--warmup 1] [--threads 2] [--rounds 1] [--json OUT]
        [--response-len N --prompts 8 --group 4] [--layers L] [--phases] [--set KEY=VALUE ...]

Same weights: a seeded kltron model saved as a kltron checkpoint, exported with tools.convert_hf.export_hf.
Same tokenizer: the shipped sentencepiece BPE model (256 pieces) rebuilt as one tokenizer.json (its ids,
the merges its ranks imply, padded with never-produced `<extra_i>` pieces to the model's vocabulary),
loaded by both sides; each prompt's ids are checked against sentencepiece's. Same work: the arithmetic
task's prompts, 32 x 8 samples, 6 new tokens (EOS stops both), reference and old log-probs, 2 epochs x 2
mini-batches of 128 rows (AdamW lr 1e-4 constant, betas (0.9, 0.999), no decay, clip 1.0), k3 KL in the
loss at beta 0.02, token-mean loss (TRL "dapo"). TRL: per_device_train_batch_size=128,
gradient_accumulation_steps=1, steps_per_generation=2, num_iterations=2: one generation serves 4
optimizer steps, and TRL computes old log-probs. Each side runs in a fresh subprocess (ru_maxrss is its
own peak); medians over `--steps` after `--warmup`. `--rounds R`: R fresh processes per side, the sides
alternating (kltron, TRL, TRL, kltron, ...), every timed step pooled, each round's median step kept: on a
shared machine the load drifts between one side's run and the other's, and alternation spreads it over both.

Phases. kltron: RLTrainer's timers; other = step minus them. TRL, by wrapping its methods: rollout =
`_generate` + `_calculate_rewards`; ref / old = `_get_per_token_logps_and_entropies` on the reference /
on the policy without grad; step = the 4 optimizer steps of one generation (TrainerCallback.on_step_end
marks); update = step minus `_generate_and_score_completions`, other = the rest of that method.
Long responses (`--response-len N`, 1..4096): every response runs to N tokens on both sides: EOS is
never drawn before N (kltron `rollout.min_new_tokens=N`, TRL `generation_kwargs={"min_new_tokens": N}`,
both setting the EOS logit to -inf, so both draw from the same distribution), and the model gets
max_seq_len = 64 + N positions. `--prompts P --group G` set the rollout (default 32 x 8; the mini-batch
is P x G / 2 rows on both sides); `--layers L` overrides the size's layer count (a smaller model of the
same shape). `--phases`: a table per model of each phase's seconds on both sides, their ratio, and
how far kltron's phase is from half of TRL's (the seconds it would have to lose for a 2x step).
`--set KEY=VALUE ...`: RLConfig overrides for the kltron side only (`rollout.record_hidden=false` drops the exact
KL(rollout || train) metric, which TRL does not compute: the two sides then do the same work).
Generation alone: core.generation.generate.generate vs transformers' generate(do_sample=True, top_k=0, top_p=1),
same model and 256-row batch, alternating; the two models' prompt logits are compared first.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from core.config import ModelConfig, load_config
from core.generation.generate import generate
from core.model import Transformer, build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel
from rl.config import RLConfig
from rl.experience.rollout import left_pad, step_prompts
from rl.experience.tasks import make_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 1234
PROMPTS, GROUP, NEW_TOKENS, EPOCHS, MINI_BATCHES, BETA, LR = 32, 8, 6, 2, 2, 0.02, 1e-4
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3 of the shipped sentencepiece model
SIZES = {
    # the default job's model (configs/grpo_tiny.yaml)
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=176,
                        max_seq_len=64, bos_id=1, eos_id=2, pad_id=0),
    # 58.5M parameters (untied embedding and head)
    "60m": ModelConfig(vocab_size=32000, hidden_size=512, n_layers=8, n_heads=8, n_kv_heads=8, intermediate_size=1408,
                       max_seq_len=64, bos_id=1, eos_id=2, pad_id=0),
}
PHASES = ("rollout", "ref_logprobs", "old_logprobs", "update", "other")


def work(a) -> dict:
    """The rollout's shape: prompts, group, new tokens and the length under which EOS is not drawn."""
    n = a.response_len or NEW_TOKENS
    return {"prompts": a.prompts, "group": a.group, "new_tokens": n, "min_new_tokens": a.response_len or 0}


def model_config(a, size: str | None = None) -> ModelConfig:
    """The size's model, with --layers and room for --response-len (64 positions + N)."""
    mc = SIZES[size or a.size]
    return dataclasses.replace(mc, n_layers=a.layers or mc.n_layers,
                               max_seq_len=mc.max_seq_len + (a.response_len or 0))


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None


def peak_rss() -> int:
    """This process's high-water resident set size in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# set-up: tokenizer.json, prompts, checkpoint, HF export
def write_hf_tokenizer(folder: str, vocab_size: int) -> None:
    """The shipped sentencepiece BPE model as tokenizer.json (+ tokenizer_config.json), padded to
    `vocab_size` ids. Merges: every split of a piece into two pieces, ranked by the piece's id
    (sentencepiece BPE ranks pieces by score = -id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    sp = load_tokenizer(None)
    pieces = [sp.id_to_piece(i) for i in range(sp.vocab_size)]
    vocab = {p: i for i, p in enumerate(pieces)}
    vocab.update({f"<extra_{i}>": i for i in range(len(pieces), vocab_size)})
    merges = sorted(((vocab[p[:k]], vocab[p[k:]], i) for i, p in enumerate(pieces) if i >= len(SPECIAL)
                     for k in range(1, len(p)) if p[:k] in vocab and p[k:] in vocab), key=lambda m: (m[2], m[0], m[1]))
    tok = Tokenizer(BPE(vocab, [(pieces[a], pieces[b]) for a, b, _ in merges], unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:  # what AutoTokenizer reads
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "padding_side": "left"}, f)


def all_prompts(n_steps: int, prompts: int = PROMPTS) -> list[list[tuple[str, dict]]]:
    """The arithmetic prompts of steps 0..n_steps-1, exactly as kltron's rollout draws them."""
    task = make_task("arithmetic", max_operand=9, ops="+", partial_credit=0.0)
    return [step_prompts(task, prompts, SEED, s, 0, 1)[1] for s in range(n_steps)]


def check_prompt_ids(hf_dir: str, n_steps: int, prompts: int = PROMPTS) -> int:
    """Every prompt: sentencepiece ids (with bos) == kltron's load_tokenizer(hf_dir) == AutoTokenizer's."""
    sp, ours = load_tokenizer(None), load_tokenizer(hf_dir)
    try:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(hf_dir)
    except ImportError:
        hf = None
    texts = [p for step in all_prompts(n_steps, prompts) for p, _ in step]
    for t in texts:
        want = [sp.bos_id] + sp.encode(t)
        got = {"kltron tokenizer.json": [ours.bos_id] + ours.encode(t)}
        if hf is not None:
            got["AutoTokenizer"] = hf(t)["input_ids"]
        for who, ids in got.items():
            if ids != want:
                raise RuntimeError(f"{hf_dir}/tokenizer.json: {who} gives {ids} for {t!r}, sentencepiece {want}")
    return len(texts)


def prepare(mc: ModelConfig, folder: str, n_steps: int, prompts: int = PROMPTS) -> dict:
    """Seeded model -> kltron checkpoint -> HF export (weights, config, tokenizer) under `folder`."""
    from core.ckpt import save_model_weights  # core.ckpt costs ~44 MiB RSS: kept out of the TRL child
    from tools.convert_hf import export_hf
    tok_dir, ckpt, hf_dir = (os.path.join(folder, n) for n in ("tokenizer", "ckpt", "hf"))
    write_hf_tokenizer(tok_dir, mc.vocab_size)
    state = init_parallel(ParallelDims(1, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    model = build_model(mc, seed=SEED)
    save_model_weights(model, ckpt, state, tokenizer_fingerprint=load_tokenizer(tok_dir).fingerprint)
    shutil.rmtree(hf_dir, ignore_errors=True)  # a previous run's export (export_hf wants an empty folder)
    export_hf(ckpt, hf_dir, tokenizer_dir=tok_dir)
    n = check_prompt_ids(hf_dir, n_steps, prompts)
    return {"ckpt": ckpt, "hf_dir": hf_dir, "params": sum(p.numel() for p in model.parameters()), "prompts_checked": n}


# the kltron side
def kltron_side(a) -> dict:
    from core.ckpt import load_model_weights
    from rl.train import assemble
    mc, w = model_config(a), work(a)
    over = [f"rollout.prompts_per_step={w['prompts']}", f"rollout.group_size={w['group']}", "rollout.temperature=1.0",
            f"rollout.max_new_tokens={w['new_tokens']}", f"rollout.min_new_tokens={w['min_new_tokens']}",
            f"algo.epochs={EPOCHS}", f"algo.mini_batches={MINI_BATCHES}",
            "algo.name=grpo", "kl.estimator=k3+", "kl.where=loss", "loss.agg=token-mean", "kl_ctl.mode=fixed",
            f"kl_ctl.beta={BETA}", f"optim.lr={LR}", f"optim.min_lr={LR}", "optim.schedule=constant", "rollout.top_k=0",
            "optim.warmup_steps=0", "optim.weight_decay=0.0", "optim.betas=[0.9, 0.999]", "optim.grad_clip=1.0",
            "reward.task=arithmetic", "reward.task_args={max_operand: 9, ops: '+', partial_credit: 0.0}",
            f"train.seed={SEED}", "train.steps=100", "train.progress=false", f"tokenizer={a.hf_dir}"]
    cfg = load_config(RLConfig, None, over + list(getattr(a, "override", None) or []))  # bench_shared_prompts' extras
    state = init_parallel(ParallelDims(1, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    tok = load_tokenizer(a.hf_dir)
    models = [Transformer(mc, state.tp_group, device="meta").to_empty(device="cpu") for _ in range(2)]
    for m in models:  # policy, reference: both from the checkpoint
        load_model_weights(m, a.ckpt, state, tokenizer_fingerprint=tok.fingerprint)
    tr = assemble(cfg, state, mc, tok, models[0], models[1])
    rss_setup = peak_rss()
    recs = [tr.step(s) for s in range(a.warmup + a.steps)][a.warmup:]
    row = {p: [r[f"time_{p}_s"] for r in recs] for p in PHASES[:4]} | {"step": [r["step_time_s"] for r in recs]}
    row["other"] = [s - sum(row[p][i] for p in PHASES[:4]) for i, s in enumerate(row["step"])]
    return {"side": "kltron", **{k: statistics.median(v) for k, v in row.items()}, "steps_s": row["step"],
            "phases_s": {p: row[p] for p in PHASES}, "reward_mean": recs[-1]["reward_mean"],
            "response_len_mean": recs[-1]["response_len"],
            "rss_after_setup": rss_setup, "peak_rss": peak_rss()}


# the TRL side
def _timed(obj, name: str, sink):
    """Replace bound method obj.name by a wrapper calling sink(seconds, args, kwargs) after each call."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sink(time.perf_counter() - t0, args, kwargs)
        return out

    setattr(obj, name, wrapper)


def _trl_args(a, out_dir: str):
    from trl import GRPOConfig

    opt_steps, w = EPOCHS * MINI_BATCHES, work(a)
    gen_kw = {"min_new_tokens": w["min_new_tokens"]} if w["min_new_tokens"] else None
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        logging_steps=10**6, disable_tqdm=True, seed=SEED, dataloader_num_workers=0,
        per_device_train_batch_size=w["prompts"] * w["group"] // MINI_BATCHES, gradient_accumulation_steps=1,
        steps_per_generation=MINI_BATCHES, num_iterations=EPOCHS, num_generations=w["group"],
        max_completion_length=w["new_tokens"], generation_kwargs=gen_kw, temperature=1.0, top_k=0, top_p=1.0,
        shuffle_dataset=False,
        beta=BETA, loss_type="dapo", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        max_steps=opt_steps * (a.warmup + a.steps), log_completions=False)


def trl_side(a) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    task = make_task("arithmetic", max_operand=9, ops="+", partial_credit=0.0)
    rows = [{"prompt": p, "answer": m["answer"]} for step in all_prompts(a.warmup + a.steps, a.prompts)
            for p, m in step]

    def reward(prompts, completions, answer, **kw):
        return [task.reward({"prompt": p, "answer": ans}, c) for p, c, ans in zip(prompts, completions, answer)]

    tok = AutoTokenizer.from_pretrained(a.hf_dir)
    model = AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32)
    ends = []

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out_dir:
        tr = GRPOTrainer(model=model, reward_funcs=reward, args=_trl_args(a, out_dir),
                         train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[StepEnd()])
        times = {k: [] for k in ("generate", "rewards", "ref_logprobs", "old_logprobs", "experience")}

        def logps_sink(dt, args, kwargs):
            model_arg = args[0] if args else kwargs["model"]
            if model_arg is tr.ref_model:
                times["ref_logprobs"].append(dt)
            elif not torch.is_grad_enabled():
                times["old_logprobs"].append(dt)

        _timed(tr, "_generate", lambda dt, *_: times["generate"].append(dt))
        _timed(tr, "_calculate_rewards", lambda dt, *_: times["rewards"].append(dt))
        _timed(tr, "_get_per_token_logps_and_entropies", logps_sink)
        _timed(tr, "_generate_and_score_completions", lambda dt, *_: times["experience"].append(dt))
        rss_setup = peak_rss()
        t_begin = time.perf_counter()
        tr.train()
    return {"side": "trl", **_trl_rows(times, [t_begin] + ends, a), "rss_after_setup": rss_setup,
            "peak_rss": peak_rss()}


def _trl_rows(times: dict, marks: list, a) -> dict:
    """Per generation g: the step is the 4 optimizer steps it serves (between on_step_end marks)."""
    k = EPOCHS * MINI_BATCHES
    n = a.warmup + a.steps
    counts = (len(times["experience"]), len(marks) - 1, len(times["old_logprobs"]), len(times["ref_logprobs"]))
    if counts != (n, n * k, n, n):
        raise RuntimeError(f"TRL ran {counts} generations / optimizer steps / old log-prob passes / reference "
                           f"log-prob passes; expected {(n, n * k, n, n)}")
    row = {"step": [], "rollout": [], "ref_logprobs": [], "old_logprobs": [], "update": [], "other": []}
    for g in range(a.warmup, n):
        step = marks[(g + 1) * k] - marks[g * k]
        exp = times["experience"][g]
        parts = {"rollout": times["generate"][g] + times["rewards"][g], "ref_logprobs": times["ref_logprobs"][g],
                 "old_logprobs": times["old_logprobs"][g]}
        for p, v in parts.items():
            row[p].append(v)
        row["update"].append(step - exp)
        row["other"].append(exp - sum(parts.values()))
        row["step"].append(step)
    return {**{p: statistics.median(v) for p, v in row.items()}, "steps_s": row["step"],
            "phases_s": {p: row[p] for p in PHASES}}


# generation alone
def generate_side(a) -> dict:
    from transformers import AutoModelForCausalLM

    from core.ckpt import load_model_weights
    mc, w = model_config(a), work(a)
    state = init_parallel(ParallelDims(1, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    tok = load_tokenizer(a.hf_dir)
    ours = Transformer(mc, state.tp_group, device="meta").to_empty(device="cpu")
    load_model_weights(ours, a.ckpt, state)
    hf = AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32).eval()
    ids, mask = left_pad([[tok.bos_id] + tok.encode(p) for p, _ in all_prompts(1, w["prompts"])[0]
                          for _ in range(w["group"])], tok.pad_id)
    with torch.no_grad():
        diff = (ours.eval()(ids, attention_mask=mask)[..., :mc.vocab_size]
                - hf(input_ids=ids, attention_mask=mask).logits)[mask.bool()].abs().max().item()
    k_tps, h_tps, counts = [], [], {}
    for rep in range(a.gen_reps + 1):
        out = generate(ours, ids, mask, max_new_tokens=w["new_tokens"], eos_id=tok.eos_id, eos_ids=tok.eos_ids,
                       pad_id=tok.pad_id, vocab_limit=tok.vocab_size, seed=SEED, step=rep,
                       min_new_tokens=w["min_new_tokens"])
        t0 = time.perf_counter()
        with torch.no_grad():
            seqs = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=w["new_tokens"],
                               min_new_tokens=w["min_new_tokens"], temperature=1.0, top_k=0, top_p=1.0,
                               pad_token_id=tok.pad_id,
                               eos_token_id=tok.eos_ids, disable_compile=True)
        dt = time.perf_counter() - t0
        resp = seqs[:, ids.shape[1]:]
        is_eos = torch.isin(resp, torch.tensor(tok.eos_ids, device="cpu")).long()
        n_hf = int((is_eos.cumsum(1) - is_eos == 0).sum())  # tokens up to and including the first EOS
        counts = {"kltron_tokens": out.n_tokens, "hf_tokens": n_hf}
        if rep > 0:  # rep 0 warms up both
            k_tps.append(out.tokens_per_s)
            h_tps.append(n_hf / dt)
    return {"side": "generate", "rows": ids.shape[0], "prompt_len": ids.shape[1], "max_logit_diff": diff, **counts,
            "kltron_tokens_per_s": statistics.median(k_tps), "hf_tokens_per_s": statistics.median(h_tps)}


# driver
def run_side(side: str, size: str, setup: dict, a) -> dict:
    """One side in a fresh interpreter; its JSON is the last line of its stdout."""
    cmd = [sys.executable, "-m", "bench.bench_rl_vs_trl", "--side", side, "--size", size, "--ckpt", setup["ckpt"],
           "--hf-dir", setup["hf_dir"], "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--threads", str(a.threads), "--gen-reps", str(a.gen_reps), "--prompts", str(a.prompts),
           "--group", str(a.group), "--layers", str(a.layers or 0), "--response-len", str(a.response_len or 0)]
    if side == "kltron" and a.override:
        cmd += ["--set", *a.override]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{side} side ({size}) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pool_rounds(runs: list[dict]) -> dict:
    """One side's rounds (fresh processes) as one row: medians over every timed step of every round, the
    highest peak RSS, the median set-up RSS, and each round's median step (`round_steps_s`)."""
    if len(runs) == 1:
        return {**runs[0], "round_steps_s": [runs[0]["step"]]}
    phases = {p: [x for r in runs for x in r["phases_s"][p]] for p in PHASES}
    steps = [x for r in runs for x in r["steps_s"]]
    return {**runs[-1], **{p: statistics.median(v) for p, v in phases.items()}, "step": statistics.median(steps),
            "steps_s": steps, "phases_s": phases, "round_steps_s": [r["step"] for r in runs],
            "peak_rss": max(r["peak_rss"] for r in runs),
            "rss_after_setup": statistics.median(r["rss_after_setup"] for r in runs)}


def phase_table(res: dict) -> list[str]:
    """Each phase on both sides: seconds, TRL / kltron, and kltron's seconds above half of TRL's (what the
    phase would have to lose for a 2x step; negative: time to spare)."""
    k, t = res["kltron"], res["trl"]
    out = ["", f"Phases, {res['size']} ({res['params'] / 1e6:.2f}M):", "",
           "| phase | kltron s | TRL s | TRL / kltron | kltron - TRL/2 s |", "|---|---:|---:|---:|---:|"]
    for p in PHASES + ("step",):
        ratio = f"{t[p] / k[p]:.2f}x" if k[p] > 0 else "-"
        out.append(f"| {p} | {k[p]:.3f} | {t[p]:.3f} | {ratio} | {k[p] - t[p] / 2:+.3f} |")
    return out


def table(results: list[dict], command: str, a, load: tuple) -> str:
    w = work(a)
    length = (f"{w['new_tokens']} new tokens (EOS stops both)" if not w["min_new_tokens"] else
              f"{w['new_tokens']}-token responses (EOS not drawn before, both sides)")
    out = [f"`{command}`", "", f"fp32, CPU, {a.threads} threads, one process per side; {w['prompts']} prompts x "
           f"{w['group']} samples, {length}" + (f", {a.layers} layers" if a.layers else "")
           + f", {EPOCHS} epochs x {MINI_BATCHES} mini-batches, beta {BETA}; median of "
           f"{a.steps} steps after {a.warmup} warm-up" + (f", pooled over {a.rounds} rounds (a fresh process per side "
           "and round, the sides alternating, the order swapped each round)" if a.rounds > 1 else "")
           + f"; 1-min load average {load[0]:.2f} at start, {load[1]:.2f} at end ({os.cpu_count()} CPUs)", "",
           "| model | side | step s | rollout s | ref log-probs s | old log-probs s | update s | other s "
           "| RSS after set-up MiB | peak RSS MiB |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        sides = [s for s in (res.get("kltron"), res.get("trl")) if s is not None]
        for s in sides:
            out.append(f"| {res['size']} ({res['params'] / 1e6:.2f}M) | {s['side']} | {s['step']:.3f} | "
                       + " | ".join(f"{s[p]:.3f}" for p in PHASES)
                       + f" | {s['rss_after_setup'] / 2**20:.0f} | {s['peak_rss'] / 2**20:.0f} |")
        if len(sides) == 2:
            k, t = sides
            out.append(f"| {res['size']} | TRL / kltron | {t['step'] / k['step']:.2f}x | "
                       + " | ".join(f"{t[p] / k[p]:.2f}x" if k[p] > 0 else "-" for p in PHASES)
                       + f" | {t['rss_after_setup'] / k['rss_after_setup']:.2f}x"
                       + f" | {t['peak_rss'] / k['peak_rss']:.2f}x |")
    per_round = [(r["size"], [t / k for k, t in zip(r["kltron"]["round_steps_s"], r["trl"]["round_steps_s"])])
                 for r in results if "trl" in r and len(r["kltron"]["round_steps_s"]) > 1]
    if a.phases:
        for res in results:
            if "trl" in res:
                out += phase_table(res)
    if per_round:
        out += ["", "TRL / kltron step, each round's medians: " + "; ".join(
            f"{size} " + ", ".join(f"{x:.2f}x" for x in ratios) for size, ratios in per_round)]
    gen = [r for r in results if "generate" in r]
    out += [] if not gen else [
        "", f"Generation alone ({w['prompts'] * w['group']} rows, {w['new_tokens']} new tokens, full-vocabulary "
            f"sampling, median of {a.gen_reps}):", "",
            "| model | kltron generate tok/s | transformers generate tok/s | kltron / HF | max logit diff |",
            "|---|---:|---:|---:|---:|"]
    for res in gen:
        g = res["generate"]
        out.append(f"| {res['size']} | {g['kltron_tokens_per_s']:.0f} | {g['hf_tokens_per_s']:.0f} | "
                   f"{g['kltron_tokens_per_s'] / g['hf_tokens_per_s']:.2f}x | {g['max_logit_diff']:.1e} |")
    if not all("trl" in r for r in results):
        out += ["", "TRL is not installed: the TRL side was skipped (pip install trl)."]
    return "\n".join(out)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,60m")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="fresh-process runs per side, alternating with the other side; steps pooled (noise)")
    ap.add_argument("--gen-reps", type=int, default=3,
                    help="timed generations per side after one warm-up (0: no generation-alone comparison)")
    ap.add_argument("--response-len", type=int, default=0,
                    help="every response runs to N tokens on both sides (EOS not drawn before N); 0: the 6-token task")
    ap.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per step")
    ap.add_argument("--group", type=int, default=GROUP, help="samples per prompt")
    ap.add_argument("--layers", type=int, default=0, help="override the size's layer count (0: the size's own)")
    ap.add_argument("--phases", action="store_true", help="a per-phase table: both sides, ratio, gap to 2x")
    ap.add_argument("--set", nargs="*", default=[], dest="override", metavar="KEY=VALUE",
                    help="further RLConfig overrides for the kltron side (e.g. rollout.record_hidden=false: no "
                         "rollout-vs-training KL, a metric TRL does not compute)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None, help="keep checkpoints and exports here (default: a temp folder)")
    for internal in ("--side", "--size", "--ckpt", "--hf-dir"):
        ap.add_argument(internal, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.gen_reps < 0 or a.rounds < 1:
        ap.error(f"need --steps >= 1, --warmup >= 0, --gen-reps >= 0, --rounds >= 1; got {a.steps}, {a.warmup}, "
                 f"{a.gen_reps}, {a.rounds}")
    if not 0 <= a.response_len <= 4096 or a.prompts < 1 or a.group < 2 or a.layers < 0 \
            or a.prompts * a.group % MINI_BATCHES:
        ap.error(f"need 0 <= --response-len <= 4096, --prompts >= 1, --group >= 2, --layers >= 0 and prompts x group "
                 f"divisible by {MINI_BATCHES}; got {a.response_len}, {a.prompts}, {a.group}, {a.layers}")
    bad = [s for s in a.sizes.split(",") if s not in SIZES]
    if bad:
        ap.error(f"--sizes: unknown {bad}; choose from {list(SIZES)}")
    return a


def main(argv=None) -> list[dict]:
    a = parse(argv)
    torch.set_num_threads(a.threads)
    if a.side is not None:  # a child: one side, JSON on stdout
        fn = {"kltron": kltron_side, "trl": trl_side, "generate": generate_side}[a.side]
        print(json.dumps(fn(a)))
        return []
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    has_trl = trl_available()
    if not has_trl:
        log("note: trl is not importable; the TRL side is skipped (pip install trl)")
    load0, results = os.getloadavg()[0], []
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            setup = prepare(model_config(a, size), os.path.join(a.workdir or tmp, size), a.warmup + a.steps,
                            a.prompts)
            # the checkpoint and export just written: flushed now, not by the kernel's writeback during the
            # first timed side (which had run ~10% slower, always round 1's first side)
            os.sync()
            res = {"size": size, "params": setup["params"], "prompts_checked": setup["prompts_checked"]}
            runs: dict[str, list[dict]] = {"kltron": [], "trl": []}
            for r in range(a.rounds):  # the sides alternate, the order swapping each round
                order = ("kltron", "trl") if has_trl else ("kltron",)
                for side in order[::-1] if r % 2 else order:
                    runs[side].append(run_side(side, size, setup, a))
                    log(f"  {size} {side} (round {r + 1}): step {runs[side][-1]['step']:.3f} s")
            for side, got in runs.items():
                if got:
                    res[side] = pool_rounds(got)
            if a.gen_reps:  # 0: no generation-alone comparison
                res["generate"] = run_side("generate", size, setup, a)
                g = res["generate"]
                log(f"  {size} generate: {g['kltron_tokens_per_s']:.0f} vs {g['hf_tokens_per_s']:.0f} tok/s")
            results.append(res)
    load = (load0, os.getloadavg()[0])
    command = "python -m bench.bench_rl_vs_trl " + " ".join(argv if argv is not None else sys.argv[1:])
    print(table(results, command.strip(), a, load))
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump({"command": command.strip(), "threads": a.threads, "steps": a.steps, "warmup": a.warmup,
                       "rounds": a.rounds, "work": work(a), "layers": a.layers,
                       "load_avg_1min": load, "trl": has_trl, "results": results}, f, indent=1)
        os.replace(a.json + ".tmp", a.json)
    return results


if __name__ == "__main__":
    main()
