"""What one RL step costs: its time split, each model's peak memory, and the memory the fused exact KL
saves against gathering logits. One process (tp = dp = 1), fp32, CPU.

    python -m bench.bench_rl_step [--configs tiny,mid] [--steps 3] [--json OUT]

1. time: median over `--steps` steps after one warm-up step of RLTrainer.step()'s phases -- rollout,
   reference log-probs, old log-probs, update (other = the rest: advantages, the critic's values for
   GAE, metrics) -- for GRPO and for PPO (with critic), and response tokens per second.
2. memory per model, after those steps (so AdamW state exists), each pass measured alone under
   torch.distributed._tools.mem_tracker.MemTracker on one update mini-batch: the policy's update
   forward+backward (fused head, the clipped loss), the reference's forward (no grad), the
   critic's forward+backward (clipped value loss). The model and its optimizer are registered with
   `track_external`, so the peak splits into parameters, gradients, optimizer state, activations
   and backward temporaries; param bytes and optimizer-state bytes are also counted from the
   tensors themselves.
3. KL memory, on one update mini-batch: (log-probs, entropy, exact forward KL to the reference),
   forward+backward through the whole policy, with the fused head (rl.update.logprobs.policy_token_stats,
   kl="forward") versus materialising the policy's and the reference's logits at the response
   positions and using torch.log_softmax. Both start from the same inputs (sequences, the
   reference's final hidden states and head weight); peaks exclude the models' parameters, so they
   are activations + temporaries + gradients produced.

The models are seeded, not trained. Responses come from sampling the untrained policy, so almost
none ends early. The reward is `digit_share` (a dense plug-in reward: the share of digits in the
response); ids beyond the shipped 256-piece tokenizer decode to one task character each.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from core.config import ModelConfig, load_config
from core.model import build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel
from rl.config import RLConfig
from rl.experience.tasks import CHARSET
from rl.models.critic import Critic
from rl.objectives.losses import aggregate, clipped_value_loss, loss_scale, policy_loss
from rl.train import assemble
from rl.update.logprobs import critic_values, logprobs_from_hidden, policy_token_stats, reference_hidden

REWARD = "bench.bench_rl_step:digit_share"


def digit_share(meta: dict, response: str) -> float:
    """Dense plug-in reward: the share of the response's characters that are digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


@dataclass
class BenchConfig:
    model: ModelConfig
    overrides: list = field(default_factory=list)  # RLConfig key=value
    kl_chunk: int = 1024  # fused head chunk for section 3


COMMON = ["reward.use_task_reward=false", f"reward.fns=[{REWARD}]", "train.progress=false", "train.steps=100",
          "optim.lr=1e-4", "optim.warmup_steps=0", "kl_ctl.beta=0.02", "train.seed=1234"]
CONFIGS = {
    # the README's default job shape (configs/grpo_tiny.yaml)
    "tiny": BenchConfig(ModelConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    intermediate_size=176, max_seq_len=64),
                        ["rollout.prompts_per_step=32", "rollout.group_size=8", "rollout.max_new_tokens=6",
                         "algo.epochs=2", "algo.mini_batches=2", "reward.task_args={max_operand: 9, ops: '+'}"],
                        kl_chunk=128),
    # ~50M parameters; prompts of ~31 tokens (14-digit operands, digits split) + 64 new tokens
    "mid": BenchConfig(ModelConfig(vocab_size=32000, hidden_size=512, n_layers=8, n_heads=8, n_kv_heads=4,
                                   intermediate_size=1408, max_seq_len=128),
                       ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=64",
                        "algo.epochs=1", "algo.mini_batches=2", "algo.kl_chunk_size=64",
                        "reward.task_args={max_operand: 99999999999999, ops: '+'}"],
                       kl_chunk=64),
}
ALGOS = {"grpo": ["algo.name=grpo", "kl.estimator=k3+", "kl.where=loss"],
         "ppo": ["algo.name=ppo", "kl.estimator=k1", "kl.where=reward"]}


class WideVocabTokenizer:
    """The shipped tokenizer, except that ids beyond its pieces (a model vocabulary larger than the
    tokenizer's, as in the mid config) decode to one character of the tasks' alphabet each."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids) -> str:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        out, run, n = [], [], self.inner.vocab_size
        for i in ids + [-1]:
            if 0 <= i < n:
                run.append(i)
                continue
            if run:
                out.append(self.inner.decode(run))
                run = []
            if i >= n:
                out.append(CHARSET[i % len(CHARSET)])
        return "".join(out)


def build_trainer(spec: BenchConfig, algo: str, seed: int = 11, extra: list | None = None):
    """RLTrainer over seeded policy / reference (same seed) / critic, one process."""
    cfg = load_config(RLConfig, None, COMMON + spec.overrides + ALGOS[algo] + list(extra or []))
    mc = spec.model
    state = init_parallel(ParallelDims(1, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    policy, ref = build_model(mc, seed=seed), build_model(mc, seed=seed)
    critic = None
    if algo == "ppo":
        critic = Critic(mc)
        critic.body.init_weights(seed)
    return assemble(cfg, state, mc, WideVocabTokenizer(load_tokenizer(None)), policy, ref, critic)


# ---------------------------------------------------------------------------------------------
# 1. time split


PHASES = ("rollout", "ref_logprobs", "old_logprobs", "update")


def time_steps(trainer, steps: int) -> dict:
    """Median of each phase over `steps` steps after one warm-up step."""
    trainer.step(0)
    recs = [trainer.step(s) for s in range(1, steps + 1)]
    med = lambda k: statistics.median(r[k] for r in recs)
    row = {p: med(f"time_{p}_s") for p in PHASES}
    row["step"] = med("step_time_s")
    row["other"] = statistics.median(r["step_time_s"] - sum(r[f"time_{p}_s"] for p in PHASES) for r in recs)
    row["tokens_per_s"] = med("tokens_per_s")
    row["response_tokens"] = statistics.median(r["response_len"] * r["samples"] for r in recs)
    row["reward_mean"] = recs[-1]["reward_mean"]
    row["grad_norm"] = recs[-1]["grad_norm"]
    return row


# ---------------------------------------------------------------------------------------------
# 2. and 3. memory


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(opt) -> int:
    return tensor_bytes(v for s in opt.opt.state.values() for v in s.values() if torch.is_tensor(v))


def tracked_peak(fn, *external) -> dict:
    """Run fn(tracker) under MemTracker with `external` (modules, optimizers, tensors) registered;
    the peak snapshot by category (bytes) and `base`, the tracked total before fn ran. fn calls
    tracker.reset_mod_stats() between two forwards of one module (MemTracker refuses them otherwise;
    the peak is kept)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    gc.collect()
    mt = MemTracker()
    mt.track_external(*external)
    with mt:
        base = sum(d["Total"] for d in mt.get_tracker_snapshot("current").values())
        fn(mt)
    peak = {}
    for d in mt.get_tracker_snapshot("peak").values():
        for k, v in d.items():
            peak[k] = peak.get(k, 0) + v
    peak["base"] = base
    return peak


def mini_batch(data, n_rows: int):
    """The first `n_rows` rows of the step's experience, as the update's mini-batch tensors."""
    ro = data.ro
    r = torch.arange(n_rows)
    return r, ro.sequences[r], ro.attention_mask[r], ro.prompt_len


def _policy_pass(tr, data, r, mt):
    cfg = tr.cfg
    ro = data.ro
    cur = policy_token_stats(tr.policy, ro.sequences[r], ro.attention_mask[r], ro.prompt_len, vocab_size=tr.vocab,
                             chunk_size=cfg.algo.kl_chunk_size, entropy=True)
    loss, _ = policy_loss(cur.logprobs, data.old_logp[r], data.advantages[r], data.mask[r], cfg.loss,
                          kl_cfg=cfg.kl, beta=tr.controller.beta, ref_logp=data.ref_logp[r], entropy=cur.entropy,
                          scale=loss_scale(data.mask[r]))
    loss.backward()


@torch.no_grad()
def _reference_pass(tr, data, r, mt):
    """What make_experience does with the reference: its hidden states and a copy of its head weight,
    then its log-probs from them by the fused head (both kept alive meanwhile, as there)."""
    ro = data.ro
    ref_h, ref_w = reference_hidden(tr.ref, ro.sequences[r], ro.attention_mask[r], ro.prompt_len)
    logprobs_from_hidden(ref_h, ref_w, ro.responses_ids[r], vocab_size=tr.vocab,
                         chunk_size=tr.cfg.algo.kl_chunk_size, mask=ro.response_mask[r])


def _critic_pass(tr, data, r, mt):
    ro = data.ro
    values = critic_values(tr.critic, ro.sequences[r], ro.attention_mask[r], ro.prompt_len)
    vloss, _ = clipped_value_loss(values, data.old_values[r], data.returns[r], data.mask[r], tr.cfg.critic.value_clip)
    aggregate(vloss, data.mask[r], "token-mean", loss_scale(data.mask[r])).backward()


def component_memory(tr, step: int) -> list[dict]:
    """Peak tensor memory of the policy / reference / critic passes on one update mini-batch."""
    data = tr.make_experience(step)
    rows_mb = data.mask.shape[0] // tr.cfg.algo.mini_batches
    r = torch.arange(rows_mb)
    tokens = int(data.mask[r].sum())
    out = []
    passes = [("policy", "forward+backward", _policy_pass, tr.policy, tr.opt),
              ("reference", "forward (no grad)", _reference_pass, tr.ref, None)]
    if tr.critic is not None:
        passes.append(("critic", "forward+backward", _critic_pass, tr.critic, tr.critic_opt))
    for name, what, fn, model, opt in passes:
        ext = [model] + ([opt.opt] if opt is not None else [])
        frozen = [p for p in model.parameters() if not p.requires_grad]
        for p in frozen:  # MemTracker hooks every parameter of a module it sees run; no_grad keeps the pass the same
            p.requires_grad_(True)
        try:
            peak = tracked_peak(lambda mt, fn=fn: fn(tr, data, r, mt), *ext)
        finally:
            for p in frozen:
                p.requires_grad_(False)
        if opt is not None:
            opt.zero_grad()
        out.append({"model": name, "pass": what, "rows": rows_mb, "seq_len": data.ro.sequences.shape[1],
                    "response_tokens": tokens, "param_bytes": tensor_bytes(model.parameters()),
                    "opt_state_bytes": optimizer_state_bytes(opt) if opt is not None else 0,
                    "peak_total": peak["Total"], "peak_param": peak["Parameter"],
                    "peak_grad": peak["Gradient"], "peak_opt": peak["Optstate"],
                    "peak_act": peak["Activation"], "peak_temp": peak["Temp"],
                    "peak_other": peak["Buffer"] + peak["Other"]})
    return out


def _logits_kl(policy, seqs, am, P, ref_h, ref_w, V):
    """What most trainers do: full logits of both models at the response positions, log_softmax."""
    zp = policy(seqs, attention_mask=am, head=lambda h, w: h[:, P - 1:-1] @ w.T)[..., :V]  # (B, N, V)
    logp = torch.log_softmax(zp.float(), -1)
    logq = torch.log_softmax((ref_h @ ref_w.T)[..., :V].float(), -1)  # (B, N, V), no grad
    p = logp.exp()
    tgt = seqs[:, P:]
    return logp.gather(-1, tgt[..., None])[..., 0], -(p * logp).sum(-1), (p * (logp - logq)).sum(-1)


def _fused_kl(policy, seqs, am, P, ref_h, ref_w, V, chunk):
    out = policy_token_stats(policy, seqs, am, P, vocab_size=V, chunk_size=chunk, entropy=True, kl="forward",
                             ref_hidden=ref_h, ref_weight=ref_w)
    return out.logprobs, out.entropy, out.kl


def kl_memory(policy, ref, seqs, am, P, V, chunk) -> list[dict]:
    """Section 3 rows: peak of (log-probs, entropy, exact KL) forward+backward, fused vs logits.
    `peak_bytes` is the tracked peak above what existed before (the models' parameters)."""
    ref_h, ref_w = reference_hidden(ref, seqs, am, P)
    B, N = seqs.shape[0], seqs.shape[1] - P
    coef = torch.randn(3, B, N, generator=torch.Generator().manual_seed(0))
    rows = []
    for method, fn in (("logits", lambda: _logits_kl(policy, seqs, am, P, ref_h, ref_w, V)),
                       ("fused", lambda: _fused_kl(policy, seqs, am, P, ref_h, ref_w, V, chunk))):
        def run(mt, fn=fn):
            outs = fn()
            sum((o * c).sum() for o, c in zip(outs, coef)).backward()

        t0 = time.perf_counter()
        peak = tracked_peak(run, policy, ref, ref_h, ref_w)
        elapsed = time.perf_counter() - t0
        for p in policy.parameters():
            p.grad = None
        rows.append({"method": method, "tokens": B * N, "vocab": V, "hidden": policy.cfg.hidden_size,
                     "chunk_size": chunk if method == "fused" else None, "peak_bytes": peak["Total"] - peak["base"],
                     "peak_grad": peak["Gradient"], "peak_act_temp": peak["Activation"] + peak["Temp"],
                     "time_s": elapsed,
                     "logits_bytes": B * N * V * 4})  # one fp32 [T, V] tensor
    rows[0]["ratio"] = 1.0
    rows[1]["ratio"] = rows[1]["peak_bytes"] / rows[0]["peak_bytes"]
    return rows


# ---------------------------------------------------------------------------------------------


def bench_config(name: str, spec: BenchConfig, steps: int, log=print) -> dict:
    res = {"config": name, "params": sum(p.numel() for p in build_model(spec.model, seed=None,
                                                                          device="meta").parameters()),
           "time": [], "memory": [], "kl_memory": []}
    trainers = {}
    for algo in ALGOS:
        tr = build_trainer(spec, algo)
        row = time_steps(tr, steps)
        res["time"].append({"algo": algo, **row})
        log(f"  {name} {algo}: step {row['step']:.2f} s")
        trainers[algo] = tr
    ppo = trainers["ppo"]
    res["memory"] = component_memory(ppo, steps + 1)
    data = trainers["grpo"].make_experience(steps + 1)
    rows_mb = data.mask.shape[0] // trainers["grpo"].cfg.algo.mini_batches
    ro = data.ro
    res["kl_memory"] = kl_memory(trainers["grpo"].policy, trainers["grpo"].ref, ro.sequences[:rows_mb],
                                 ro.attention_mask[:rows_mb], ro.prompt_len, spec.model.vocab_size, spec.kl_chunk)
    cfg = trainers["grpo"].cfg
    res["shape"] = {"prompts": cfg.rollout.prompts_per_step, "group_size": cfg.rollout.group_size,
                    "max_new_tokens": cfg.rollout.max_new_tokens, "prompt_len": ro.prompt_len,
                    "epochs": cfg.algo.epochs, "mini_batches": cfg.algo.mini_batches,
                    "kl_chunk_size": cfg.algo.kl_chunk_size}
    return res


def _mib(b) -> str:
    return f"{b / 2**20:.2f}"


def tables(results: list[dict], command: str, steps: int, load: tuple) -> str:
    out = [f"`{command}`", "", f"fp32, CPU, tp=1 dp=1, {torch.get_num_threads()} threads; time = median of {steps} "
           f"steps after 1 warm-up; 1-min load average {load[0]:.2f} at start, {load[1]:.2f} at end "
           f"({os.cpu_count()} CPUs)", ""]
    out += ["| config | params | shape | algo | rollout s | ref log-probs s | old log-probs s | update s | other s "
            "| step s | tokens/s |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        s = res["shape"]
        shape = (f"{s['prompts']}x{s['group_size']}, P={s['prompt_len']}+{s['max_new_tokens']}, "
                 f"{s['epochs']} ep x {s['mini_batches']} mb")
        for t in res["time"]:
            out.append(f"| {res['config']} | {res['params'] / 1e6:.2f}M | {shape} | {t['algo']} | {t['rollout']:.3f} "
                       f"| {t['ref_logprobs']:.3f} | {t['old_logprobs']:.3f} | {t['update']:.3f} | {t['other']:.3f} "
                       f"| {t['step']:.3f} | {t['tokens_per_s']:.0f} |")
    out += ["", "Peak tensor memory (MemTracker, MiB) of each model's pass on one update mini-batch, after "
            "optimizer steps:", "",
            "| config | model | pass | rows x seq | params | opt state | peak total | = params | + grads | + opt "
            "| + activations | + temps |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        for m in res["memory"]:
            out.append(f"| {res['config']} | {m['model']} | {m['pass']} | {m['rows']} x {m['seq_len']} "
                       f"| {_mib(m['param_bytes'])} | {_mib(m['opt_state_bytes'])} | {_mib(m['peak_total'])} "
                       f"| {_mib(m['peak_param'])} | {_mib(m['peak_grad'])} | {_mib(m['peak_opt'])} "
                       f"| {_mib(m['peak_act'])} | {_mib(m['peak_temp'])} |")
    out += ["", "(log-probs, entropy, exact KL to the reference), forward+backward through the policy on one update "
            "mini-batch; peak above the models' parameters (MiB):", "",
            "| config | tokens T | vocab V | method | peak | of which grads | of which acts+temps | peak vs logits "
            "| one [T,V] fp32 | time s |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        for k in res["kl_memory"]:
            label = "logits + log_softmax" if k["method"] == "logits" else f"fused head (chunk {k['chunk_size']})"
            out.append(f"| {res['config']} | {k['tokens']} | {k['vocab']} | {label} | {_mib(k['peak_bytes'])} "
                       f"| {_mib(k['peak_grad'])} | {_mib(k['peak_act_temp'])} | {k['ratio']:.3f} "
                       f"| {_mib(k['logits_bytes'])} | {k['time_s']:.2f} |")
    return "\n".join(out)


def main(argv=None, configs: dict | None = None) -> list[dict]:
    """Run the benchmark; `configs` replaces CONFIGS (tests pass a micro config)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    configs = configs or CONFIGS
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in configs]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {list(configs)}")
    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    load0 = os.getloadavg()[0]
    results = [bench_config(n, configs[n], a.steps, log) for n in names]
    load = (load0, os.getloadavg()[0])
    command = "python -m bench.bench_rl_step " + " ".join(argv if argv is not None else sys.argv[1:])
    print(tables(results, command.strip(), a.steps, load))
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"command": command.strip(), "threads": torch.get_num_threads(), "steps": a.steps,
                       "load_avg_1min": load, "results": results}, f, indent=1)
        os.replace(tmp, a.json)
    return results


if __name__ == "__main__":
    main()
