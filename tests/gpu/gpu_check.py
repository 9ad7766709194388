"""The driver of scripts/gpu_check.sh: run each section as its own process under a time budget,
collect its JSON, write everything to one file and print a table.

    python -m tests.gpu.gpu_check --out DIR [--cpu] [--budget 470]

Sections (GPU / --cpu tiny version):
  layout       layout equivalence (tests/test_layout.py's checks), NCCL under torchrun, every
               dp x tp the GPU count allows / gloo, one process; + a bf16 SFT sanity run
  hf_parity    tools/convert_hf logits vs transformers on the device, tp = 1 (and 2 with 2 GPUs)
  mfu_eager    bench.bench_mfu: ~1B Llama, bf16, forward+backward+AdamW, tokens/s and MFU / tiny on CPU
  grpo_tiny    the default GRPO job (configs/grpo_tiny.yaml), step time split and peak memory per phase
  grpo_0p5b    configs/grpo_0p5b_gpu.yaml (Qwen2.5-0.5B shape, bf16, bf16 reference, exact KL)
               / the same config shrunk to the tiny shape on CPU
  kl_head      bench.bench_kl_device: fused exact-KL head vs gathering logits, T=32768 H=4096
               V=128256 bf16 / T=1024 H=64 V=4096 fp32 on CPU
  bf16_kl      bench.bench_bf16_kl --device: exact-KL error of the heads with bf16 inputs
  context_parallel  tests/gpu/cp_check.py: cp=2 ring / Ulysses exactness under NCCL (>= 2 GPUs, else gloo on
               the CPU) and the GRPO update at T=32768, H=1024 per rank against cp=1 / T=1024 H=64 on CPU
  invariant    tests/gpu/invariant_check.py: batch-invariant mode, fp32 and bf16: the rollout's recorded hidden
               states and log-probs equal the trainer's (padded and shared layouts) bit for bit, KL(rollout ||
               train) exactly 0; the mismatch with the mode off in bf16; generation + forward time on / off
  mfu_compile  mfu_eager with torch.compile'd blocks (compile time = the warm-up steps); run last
Each section: status ok | failed | timeout | skipped, seconds, result (its JSON), log file. On the GPU each command
is its own process; with --cpu each is a fork of this process, which has imported every section's module once
(the commands' own start-up and imports were most of the CPU version's time).
Exit status: the number of sections not ok (skipped ones excepted).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback

import torch

from core.runtime.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASES = ("rollout", "ref", "old", "update")
TIMES = ("rollout", "ref_logprobs", "old_logprobs", "update")


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def grpo_summary(run_dir: str) -> dict:
    """Mean step time split and max peak memory per phase over the steps after the first (or all
    if only one), from the run's metrics.jsonl."""
    recs = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    if not recs:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no steps")
    body = recs[1:] or recs
    mean = lambda k: sum(float(r.get(k, 0.0)) for r in body) / len(body)
    out = {"steps": len(recs), "step_time_s": mean("step_time_s"), "tokens_per_s": mean("tokens_per_s"),
           "reward_first": recs[0]["reward_mean"], "reward_last": recs[-1]["reward_mean"],
           "kl_mean_last": recs[-1]["kl_mean"], "peak_mem_kind": recs[-1].get("peak_mem_phase_kind"),
           "peak_mem_bytes": max(int(r.get("peak_mem_bytes", 0)) for r in recs)}
    for t in TIMES:
        out[f"time_{t}_s"] = mean(f"time_{t}_s")
    for p in PHASES:
        out[f"peak_mem_{p}_bytes"] = max(int(r.get(f"peak_mem_{p}_bytes", 0)) for r in body)
    missing = [k for k, v in out.items() if k.startswith("peak_mem_") and k.endswith("_bytes") and not v]
    if missing:
        raise RuntimeError(f"metrics.jsonl lacks {missing}")
    return out


def sections(out: str, cpu: bool, ngpu: int) -> list[dict]:
    """[{name, cmds: [argv...], json: path | None, summary: callable | None, timeout}] in run order."""
    py, j = sys.executable, lambda n: os.path.join(out, f"{n}.json")
    s = []
    lay = [[py, "-m", "tests.gpu.layout_nccl", "--cpu", "--bf16-sanity", "--json", j("layout")]] if cpu else \
        [_torchrun(1) + ["-m", "tests.gpu.layout_nccl", "--bf16-sanity", "--json", j("layout")]] + \
        [_torchrun(n) + ["-m", "tests.gpu.layout_nccl", "--json", j(f"layout_{n}")] for n in (2, 4, 8) if ngpu >= n]
    s.append(dict(name="layout", cmds=lay, json=j("layout"), more=[j(f"layout_{n}") for n in (2, 4, 8)],
                  timeout=150))
    hf = [[py, "-m", "tests.gpu.hf_parity", "--cpu", "--json", j("hf_parity")]] if cpu else \
        [_torchrun(1) + ["-m", "tests.gpu.hf_parity", "--json", j("hf_parity")]] + \
        ([_torchrun(2) + ["-m", "tests.gpu.hf_parity", "--json", j("hf_parity_tp2")]] if ngpu >= 2 else [])
    s.append(dict(name="hf_parity", cmds=hf, json=j("hf_parity"), more=[j("hf_parity_tp2")], timeout=90))
    mfu = [py, "-m", "bench.bench_mfu"] + (["--cpu", "--steps", "2", "--warmup", "1"] if cpu else
                                           ["--seq", "2048", "--mb", "4", "--steps", "10", "--warmup", "3"])
    if not cpu and ngpu > 1:
        mfu = _torchrun(ngpu) + mfu[1:]
    s.append(dict(name="mfu_eager", cmds=[mfu + ["--json", j("mfu_eager")]], json=j("mfu_eager"), timeout=120))
    dev = "cpu" if cpu else "cuda"
    tiny = [f"train.device={dev}", "train.progress=false", "train.resume=false", "train.save_every=0"]
    tiny += (["train.steps=2", "init.sft_steps=5", "rollout.prompts_per_step=8", "rollout.group_size=4"] if cpu
             else ["train.steps=20"])
    for name, cfg, extra in (
            ("grpo_tiny", "grpo_tiny.yaml", tiny),
            ("grpo_0p5b", "grpo_0p5b_gpu.yaml",
             [f"train.device={dev}", "train.progress=false", "train.resume=false"] + (
                 ["train.steps=2", "init.sft_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
                  "rollout.max_new_tokens=8", "algo.micro_batch_size=4", "model.vocab_size=512",
                  "model.hidden_size=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                  "model.intermediate_size=128"] if cpu else []))):
        run_dir = os.path.join(out, name)
        cmd = [py, "-m", "rl.train", "--config", os.path.join(REPO, "configs", cfg),
               f"train.out_dir={run_dir}", f"init.sft_dir={run_dir}_init"] + extra
        s.append(dict(name=name, cmds=[cmd], json=None, summary=lambda d=run_dir: grpo_summary(d),
                      timeout=120 if cpu else 150))
    kl = [py, "-m", "bench.bench_kl_device", "--device", "cpu" if cpu else "cuda", "--json", j("kl_head")]
    kl += ["--tokens", "1024", "--hidden", "64", "--vocab", "4096", "--dtype", "fp32"] if cpu else []
    s.append(dict(name="kl_head", cmds=[kl], json=j("kl_head"), timeout=150))
    bk = [py, "-m", "bench.bench_bf16_kl", "--device", dev, "--json", j("bf16_kl")]
    bk += ["--tokens", "128", "--vocab", "4096"] if cpu else []
    s.append(dict(name="bf16_kl", cmds=[bk], json=j("bf16_kl"), timeout=60))
    s.append(kl_memory_section(py, j, cpu))
    sm = [py, "-m", "bench.bench_sampler", "--skip-gen", "--old-ref", "none", "--json", j("sampler")]
    sm += ["--repeats", "1", "--rows", "64", "--vocab", "4096"] if cpu else ["--device", "cuda", "--repeats", "10"]
    s.append(dict(name="sampler", cmds=[sm], json=j("sampler"), timeout=90))
    lc = [py, "-m", "bench.bench_layout_cost", "--device", dev, "--json", j("layout_cost")]
    lc += (["--hidden", "64", "--shapes", "16x6,32x64", "--groups", "2", "--group-size", "4", "--repeats", "1"] if cpu
           else ["--hidden", "1024", "--layers", "4", "--dtype", "bf16", "--shapes", "64x64,64x512,256x2048",
                 "--repeats", "3"])
    s.append(dict(name="layout_cost", cmds=[lc], json=j("layout_cost"), timeout=90))
    cp = [py, "-m", "tests.gpu.cp_check", "--json", j("context_parallel")] + (["--cpu"] if cpu else [])
    s.append(dict(name="context_parallel", cmds=[cp], json=j("context_parallel"), timeout=150 if cpu else 300))
    inv = [py, "-m", "tests.gpu.invariant_check", "--json", j("invariant")] + (["--cpu"] if cpu else [])
    s.append(dict(name="invariant", cmds=[inv], json=j("invariant"), timeout=90 if cpu else 240))
    # last: compilation time is the least predictable, and the other sections must not wait on it
    s.append(dict(name="mfu_compile", cmds=[mfu + ["--compile", "--json", j("mfu_compile")]],
                  json=j("mfu_compile"), timeout=240))
    return s


KL_METHODS = "matmul_floor,gather,fused_exact_loss,fused_k3_loss"


def kl_memory_section(py: str, j, cpu: bool) -> dict:
    """The KL-cost device rows: tools.kl_memory measured (allocator peak, median time) and projected
    (meta tensors) at one shape; the summary pairs them by method."""
    shape = ["--tokens", "256", "--hidden", "64", "--vocab", "4096", "--dtype", "fp32"] if cpu else \
        ["--tokens", "8192", "--hidden", "4096", "--vocab", "128256", "--dtype", "bf16"]
    base = [py, "-m", "tools.kl_memory", *shape, "--methods", KL_METHODS]
    dev = ["--device", "cpu" if cpu else "cuda"]
    reps = ["--warmup", "0", "--repeats", "1"] if cpu else ["--warmup", "1", "--repeats", "3"]
    cmds = [base + dev + reps + ["--json", j("kl_measured")],
            base + dev + ["--project", "--json", j("kl_projected")]]
    return dict(name="kl_memory", cmds=cmds, json=None, timeout=150,
                summary=lambda: kl_memory_summary(j("kl_measured"), j("kl_projected")))


def kl_memory_summary(measured: str, projected: str) -> dict:
    """Per method: measured peak and time (and time / matmul floor), projected peak and its error;
    gather / fused exact peak, fused exact / fused k3 peak and time."""
    meas = {r["name"]: r for r in _load(measured)}
    proj = {r["name"]: r for r in _load(projected)}
    rows = {n: dict(peak_bytes=r["peak_bytes"], time_s=r["time_s"], time_vs_floor=r.get("time_vs_floor"),
                    projected_bytes=proj.get(n, {}).get("peak_bytes"),
                    projection_error=(proj[n]["peak_bytes"] / r["peak_bytes"] - 1) if n in proj else None)
            for n, r in meas.items()}
    ex, k3, ga = meas["fused_exact_loss"], meas["fused_k3_loss"], meas["gather"]
    return dict(device=ex["device"], tokens=ex["tokens"], hidden=ex["hidden"], vocab=ex["vocab"], dtype=ex["dtype"],
                methods=rows, gather_over_exact_memory=ga["peak_bytes"] / ex["peak_bytes"],
                exact_over_k3_memory=ex["peak_bytes"] / k3["peak_bytes"],
                exact_over_k3_time=ex["time_s"] / k3["time_s"])


def preload(secs: list[dict]) -> None:
    """--cpu: import every section's module (and the compiler the compiled sections use) once in this process,
    so that each command forked from it (`run_forked`) starts without an interpreter start-up and the imports."""
    for sec in secs:
        for cmd in sec["cmds"]:
            importlib.import_module(cmd[2])
    import torch._inductor.compile_fx  # noqa: F401 - torch.compile's first call imports it otherwise


def run_forked(cmd: list[str], lf, env: dict, timeout: float) -> int:
    """Run `python -m MODULE ARGS...` (--cpu) in a fork of this process, as `-m` would (the module as
    __main__, the same argv, the section's environment and log); its process group is killed at `timeout`
    (raises subprocess.TimeoutExpired). Returns the exit status."""
    assert cmd[0] == sys.executable and cmd[1] == "-m", cmd
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.setsid()
            os.dup2(lf.fileno(), 1)
            os.dup2(lf.fileno(), 2)
            os.chdir(REPO)
            os.environ.clear()
            os.environ.update(env)
            if env.get("OMP_NUM_THREADS"):
                torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
            sys.argv = [cmd[2], *cmd[3:]]
            sys.modules.pop(cmd[2], None)  # preloaded: run afresh as __main__, as `-m` does
            try:
                runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported in the log, exit status 1
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(cmd, timeout)
        time.sleep(0.05)


def run_section(sec: dict, out: str, remaining: float, env: dict, fork: bool = False) -> dict:
    t0 = time.perf_counter()
    log = os.path.join(out, "logs", f"{sec['name']}.log")
    rec = {"status": "ok", "log": log, "commands": [" ".join(c) for c in sec["cmds"]]}
    with open(log, "w") as lf:
        for cmd in sec["cmds"]:
            left = min(sec["timeout"], remaining - (time.perf_counter() - t0))
            if left < 5:
                rec["status"] = "timeout"
                break
            lf.write(f"+ {' '.join(cmd)}\n")
            lf.flush()
            try:
                rc = run_forked(cmd, lf, env, left) if fork else \
                    subprocess.run(cmd, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT, timeout=left).returncode
            except subprocess.TimeoutExpired:
                rec["status"] = "timeout"
                break
            if rc != 0:
                rec["status"], rec["error"] = "failed", f"exit {rc}: {' '.join(cmd)}"
                break
    if rec["status"] == "ok":
        try:
            rec["result"] = sec["summary"]() if sec.get("summary") else _load(sec["json"])
            for extra in sec.get("more", []):
                if os.path.exists(extra):
                    rec["result"][os.path.basename(extra)[:-5]] = _load(extra)
        except Exception as e:  # noqa: BLE001 - a section without its result failed
            rec["status"], rec["error"] = "failed", f"no result: {type(e).__name__}: {e}"
    if rec["status"] != "ok":
        with open(log) as lf:
            rec["log_tail"] = lf.read()[-3000:]
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _mib(b) -> str:
    return f"{b / 2**20:.0f}" if b else "-"


def headline(name: str, r: dict) -> str:
    """One line of the section's main numbers."""
    if name == "layout":
        ok = sum(c["ok"] for c in r["checks"])
        return f"{ok}/{len(r['checks'])} checks pass ({r['backend']}, world {r['world']})"
    if name == "hf_parity":
        errs = [v.get("max_abs_err", float("nan")) for v in r["kinds"].values()]
        return f"{', '.join(r['kinds'])} on {r['device']}: max |logits diff| {max(errs):.2e}"
    if name.startswith("mfu"):
        mfu = f"MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "MFU n/a"
        return (f"{r['model']} {r['dtype']}: {r['tokens_per_s']:,.0f} tok/s, {r['step_s'] * 1e3:.0f} ms/step, {mfu}, "
                f"warm-up {r['compile_s']:.1f}s"
                + (f", peak {r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") else ""))
    if name.startswith("grpo"):
        t = "/".join(f"{r[f'time_{k}_s']:.2f}" for k in TIMES)
        m = "/".join(_mib(r[f"peak_mem_{p}_bytes"]) for p in PHASES)
        return (f"{r['step_time_s']:.2f} s/step (rollout/ref/old/update {t} s), peak MiB {m} "
                f"[{r['peak_mem_kind']}], reward {r['reward_first']:.3f}->{r['reward_last']:.3f}")
    if name == "kl_head":
        rows = {m["method"]: m for m in r["methods"]}
        parts = [f"{k}: " + (f"{_mib(v['peak_bytes'])} MiB {v['time_s'] * 1e3:.0f} ms" if v["status"] == "ok"
                             else v["status"]) for k, v in rows.items()]
        ratio = (f"; fused/gather memory {r['fused_over_gather_memory']:.3f}, time {r['fused_over_gather_time']:.2f}"
                 if "fused_over_gather_memory" in r else "")
        return f"T={r['tokens']} H={r['hidden']} V={r['vocab']} {r['dtype']}: " + ", ".join(parts) + ratio
    if name == "bf16_kl":
        return (f"KL max abs err: fused {r['fused']['max_abs_err']:.1e}, bf16 logits "
                f"{r['bf16_logits']['max_abs_err']:.1e} (true KL {r['true_kl_mean']:.1e})")
    if name == "kl_memory":
        err = max(abs(v["projection_error"]) for v in r["methods"].values() if v["projection_error"] is not None)
        floor = r["methods"]["fused_exact_loss"]["time_vs_floor"]
        return (f"T={r['tokens']} H={r['hidden']} V={r['vocab']} {r['dtype']} on {r['device']}: gather/exact memory "
                f"{r['gather_over_exact_memory']:.1f}x, exact/k3 memory {r['exact_over_k3_memory']:.3f}x time "
                f"{r['exact_over_k3_time']:.2f}x, exact time/floor {floor:.2f}x, max projection error {100 * err:.1f}%")
    if name == "sampler":
        sm = r["sampler"]
        shape = ", ".join(str(n) for n in sm.get("shape", (256, 32000)))
        return (f"[{shape}] on {sm.get('device', 'cpu')}: eager {sm['eager']['ratio']:.2f}x, compiled "
                f"{sm['compiled']['ratio']:.2f}x multinomial (compile {sm['compile_s']:.1f} s), top_p "
                f"{sm['eager top_p=0.9']['ratio']:.2f}x")
    if name == "layout_cost":  # the shared layout's default plan and the cost model's, each against padding
        return f"{r['dtype']} on {r['device']}, time / padded: " + "; ".join(
            f"{x['P']}x{x['N']} default {x['default']['s'] / x['padded']['s']:.2f}, cost plan "
            f"{x['cost']['s'] / x['padded']['s']:.2f}" for x in r["rows"])
    if name == "context_parallel":
        ok = sum(c["ok"] for c in r["checks"])
        steps = ", ".join(f"{'cp=1' if x['cp'] == 1 else x['impl']} {_mib(x['peak_bytes'])} MiB {x['time_s']:.2f} s"
                          for x in r["steps"])
        return (f"{ok}/{len(r['checks'])} exact ({r['backend']}); T={r['tokens']} H={r['hidden']} per rank: {steps}"
                + (" (cp=2 needs 2 GPUs: skipped)" if r.get("cp2_skipped") else ""))
    if name == "invariant":
        ok = sum(c["ok"] for c in r["checks"])
        off = r.get("off_bf16") or {}
        t = ", ".join(f"{k} on/off {v['on_over_off']:.2f}x" for k, v in r["timing"].items())
        return (f"{ok}/{len(r['checks'])} bit-equal on {r['device']}; mode off bf16: max |dlogp| "
                f"{off.get('logp_max_abs_diff_padded', float('nan')):.1e}, KL max "
                f"{off.get('rollout_kl_max_padded', float('nan')):.1e}; {t}")
    return ""


def print_table(report: dict) -> None:
    print(f"\nkltron gpu_check ({report['mode']}, {report['device']}, {report['total_s']:.0f} s)")
    print(f"| {'section':<11} | {'status':<7} | {'s':>6} | result")
    print(f"|{'-' * 13}|{'-' * 9}|{'-' * 8}|{'-' * 40}")
    for name, rec in report["sections"].items():
        try:
            line = headline(name, rec["result"]) if rec["status"] == "ok" else rec.get("error", "")
        except (KeyError, TypeError, ValueError) as e:
            line = f"(result unreadable: {e})"
        print(f"| {name:<11} | {rec['status']:<7} | {rec.get('seconds', 0):>6.1f} | {line}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="the tiny CPU version")
    ap.add_argument("--budget", type=float, default=470.0, help="seconds for all sections together")
    ap.add_argument("--only", default=None, help="comma-separated section names")
    args = ap.parse_args(argv)
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cpu = args.cpu or ngpu == 0
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1" if cpu else "8")
    report = {"mode": "cpu" if cpu else "gpu", "device": torch.cuda.get_device_name(0) if ngpu else "cpu",
              "gpus": ngpu, "torch": torch.__version__, "sections": {}}
    t0 = time.perf_counter()
    only = set(args.only.split(",")) if args.only else None
    secs = [sec for sec in sections(args.out, cpu, ngpu) if not only or sec["name"] in only]
    if cpu:
        preload(secs)
    for sec in secs:
        remaining = args.budget - (time.perf_counter() - t0)
        rec = run_section(sec, args.out, remaining, env, fork=cpu) if remaining > 5 else \
            {"status": "timeout", "seconds": 0, "error": "no time left in --budget"}
        report["sections"][sec["name"]] = rec
        print(f"[{rec['status']}] {sec['name']} ({rec.get('seconds', 0):.0f} s)", flush=True)
    report["total_s"] = time.perf_counter() - t0
    path = os.path.join(args.out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)
    print(f"\nwritten: {path}")
    return sum(r["status"] not in ("ok", "skipped") for r in report["sections"].values())


if __name__ == "__main__":
    sys.exit(main())
