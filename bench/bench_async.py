"""One-step-off asynchronous RL against synchronous, on two ranks of one thread each (docs/async.md).

    python -m bench.bench_async [--steps 6] [--warmup 2] [--new-tokens 64] [--prompts 4] [--group 4]
                                [--rounds 1] [--work DIR] [--json OUT]

The 58.5M bench model (bench/bench_rl_vs_trl.py's "60m": hidden 512, 8 layers, vocab 32000, seeded, and
its 32000-id tokenizer.json) runs GRPO under `torchrun --nproc_per_node 2 -m rl.train`, OMP_NUM_THREADS=1,
in three launches that differ only in layout:

- `split_k1`: parallel.rollout_ranks=1, algo.max_staleness=1 with the decoupled correction (as
  configs/grpo_tiny_async.yaml) -- rank 1 generates step s+1 while rank 0 updates step s, then rank 0
  broadcasts the new weights (one-step-off);
- `split_k0`: the same two disjoint ranks with algo.max_staleness=0 -- each waits for the other;
- `colocated`: both ranks train and generate (dp=2, FSDP), each its half of the prompts.

Every response is `--new-tokens` long (rollout.min_new_tokens = max_new_tokens), so rollout and
update cost the same every step. Per launch: steps/s over the steps after `--warmup` (the trainer's
time between consecutive steps: `pipeline_step_s` for the split runs, `step_time_s` colocated), the
median generation time (`rollout_s` of the generating rank), the median trainer-side phases and
weight-sync time. The ratio split_k1 / split_k0 is the pipeline's gain on the same ranks. On a shared
machine whose speed changes between launches, `overlap` (a split run's phases added up, over its step
time: 1 when nothing overlaps) compares each run with itself: its k1 / k0 ratio is the gain at equal
speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {
    "split_k1": ["parallel.rollout_ranks=1", "algo.max_staleness=1", "algo.off_policy.correction=decoupled"],
    "split_k0": ["parallel.rollout_ranks=1", "algo.max_staleness=0"],
    "colocated": ["parallel.rollout_ranks=0"],
}


def prepare(work: str, new_tokens: int) -> tuple[str, str]:
    """The seeded 58.5M checkpoint and its tokenizer under `work` (reused when present)."""
    import dataclasses

    from bench.bench_rl_vs_trl import SEED, SIZES, write_hf_tokenizer
    from core.ckpt import save_model_weights
    from core.model import build_model
    from core.tokenizer import load_tokenizer

    mc = dataclasses.replace(SIZES["60m"], max_seq_len=32 + new_tokens)
    tok_dir, ckpt = os.path.join(work, "tokenizer"), os.path.join(work, f"ckpt_{mc.max_seq_len}")
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        write_hf_tokenizer(tok_dir, mc.vocab_size)
    if not os.path.isfile(os.path.join(ckpt, "manifest.json")):
        save_model_weights(build_model(mc, seed=SEED), ckpt, None,
                           tokenizer_fingerprint=load_tokenizer(tok_dir).fingerprint)
    return ckpt, tok_dir


def overrides(a, ckpt: str, tok_dir: str, out: str) -> list[str]:
    n = a.new_tokens
    return ["--config", os.path.join(REPO, "configs", "grpo_tiny.yaml"), f"init.checkpoint={ckpt}",
            f"tokenizer={tok_dir}", f"train.out_dir={out}", f"train.steps={a.warmup + a.steps}", "train.save_every=0",
            "train.progress=false", "rollout.eval_every=0", f"rollout.prompts_per_step={a.prompts}",
            f"rollout.group_size={a.group}", f"rollout.max_new_tokens={n}", f"rollout.min_new_tokens={n}",
            "rollout.record_hidden=false", "algo.epochs=1", "algo.mini_batches=1", "parallel.tp=1",
            "parallel.dp=-1", "reward.task_args={max_operand: 9, ops: '+', partial_credit: 0.5}",
            "guard.kl_stop_per_token=null", "guard.kl_warn_per_token=null"]


def launch(args: list[str], timeout: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "rl.train",
           *args]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")


def summarise(rows: list[dict], warmup: int, split: bool) -> dict:
    rest = rows[warmup:]
    wall = [r["pipeline_step_s" if split else "step_time_s"] for r in rest]
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rest)  # noqa: E731
    gen = [r["response_len"] * r["samples"] / max(r["rollout_tokens_per_s"], 1e-9) for r in rest]
    out = {"steps": len(rest), "steps_per_s": len(rest) / sum(wall), "step_s": statistics.median(wall),
           "generate_s": statistics.median(gen), "trainer_wait_s": med("rollout_wait_s") if split else 0.0,
           "ref_s": med("time_ref_logprobs_s"), "old_s": med("time_old_logprobs_s"), "update_s": med("time_update_s"),
           "weight_sync_s": med("weight_sync_s"), "reward_mean": statistics.mean(r["reward_mean"] for r in rest)}
    if split:  # the same run's own phases, added up: what the step would cost with nothing overlapped
        out["staleness_max"] = max(r["staleness_max"] for r in rest)
        out["serial_s"] = out["generate_s"] + out["ref_s"] + out["old_s"] + out["update_s"] + out["weight_sync_s"]
        out["overlap"] = out["serial_s"] / out["step_s"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_async", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--work", default=os.path.join("runs", "bench_async"))
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    ckpt, tok_dir = prepare(a.work, a.new_tokens)
    load = os.getloadavg()
    results: dict[str, list[dict]] = {m: [] for m in a.modes.split(",")}
    for rnd in range(a.rounds):
        for mode in results:  # interleaved: a busy spell on the shared machine hits every mode of a round
            out = os.path.join(a.work, f"{mode}_{rnd}_{int(time.time())}")
            launch(overrides(a, ckpt, tok_dir, out) + MODES[mode], a.timeout)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            results[mode].append(summarise(rows, a.warmup, mode.startswith("split")))
            print(f"round {rnd} {mode}: {json.dumps(results[mode][-1])}", flush=True)
    best = {m: max(rs, key=lambda r: r["steps_per_s"]) for m, rs in results.items()}
    ratios = {}
    if "split_k1" in best and "split_k0" in best:
        ratios["split_k1 / split_k0"] = best["split_k1"]["steps_per_s"] / best["split_k0"]["steps_per_s"]
        ratios["rounds"] = [r1["steps_per_s"] / r0["steps_per_s"] for r1, r0 in
                            zip(results["split_k1"], results["split_k0"])]
    if "split_k1" in results and "split_k0" in results:  # load-normalised: each run against its own phases
        ratios["overlap k1 / k0"] = [r1["overlap"] / r0["overlap"] for r1, r0 in
                                     zip(results["split_k1"], results["split_k0"])]
    if "split_k1" in best and "colocated" in best:
        ratios["split_k1 / colocated"] = best["split_k1"]["steps_per_s"] / best["colocated"]["steps_per_s"]
    report = {"results": results, "ratios": ratios, "load_before": load, "load_after": os.getloadavg(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores", "argv": sys.argv[1:]}
    print(json.dumps(ratios, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
