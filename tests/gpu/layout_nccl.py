"""Layout equivalence (tests/test_layout.py's checks) on GPUs with NCCL, under torchrun:

    torchrun --standalone --nproc_per_node N -m tests.gpu.layout_nccl [--bf16-sanity] [--json OUT]
    python -m tests.gpu.layout_nccl --cpu      # CPU/gloo fallback, 1 process (checks the path)

Under torchrun on GPUs the NCCL process group is created even for N = 1 (tp = dp = 1: the groups
exist, and every collective is an identity on one rank).

Runs every layout of test_layout.LAYOUTS with dp * tp == N, both model variants (with tp > 1 also
with sequence parallelism), fp32 with TF32 off, each rank against a single-GPU reference it computes
itself (atol=rtol=1e-5). With
--bf16-sanity (1 process): 30 SFT steps of the tiny config with bf16 autocast; loss finite and
dropping. Prints one PASS/FAIL line per check on rank 0; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from tests.test_layout import LAYOUTS, VARIANTS, layout_run


def bf16_sanity(device: str) -> str:
    from core.config import SFTConfig, load_config
    from core.sft import train

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(SFTConfig, os.path.join(repo, "configs", "sft_tiny.yaml"),
                      ["parallel.mixed_precision=bf16", "train.steps=30", f"train.device={device}",
                       "train.progress=false", "train.resume=false", "train.out_dir=/tmp/kltron_bf16_sanity"])
    losses = train(cfg)["losses"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"bf16 loss did not drop: {first:.3f} -> {last:.3f}"
    return f"loss {first:.3f} -> {last:.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--bf16-sanity", action="store_true")
    ap.add_argument("--json", default=None, help="write {checks: [{name, ok, detail}], ...} here (rank 0)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if "RANK" in os.environ and not dist.is_initialized():  # under torchrun: NCCL, even on one GPU
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    failed = 0
    checks = []

    def report(name: str, fn):
        nonlocal failed
        try:
            detail = fn()
            ok = True
        except Exception:  # noqa: BLE001 - reported, then the next check runs
            ok, detail = False, traceback.format_exc(limit=3)
        if world > 1:  # everyone agrees on the verdict
            flag = torch.tensor([0.0 if ok else 1.0], device=device)
            dist.all_reduce(flag)
            ok = ok and flag.item() == 0
        failed += not ok
        checks.append({"name": name, "ok": ok, "detail": detail})
        if rank == 0:
            print(f"[{'PASS' if ok else 'FAIL'}] {name} ({'nccl' if cuda else 'gloo'}, world {world})"
                  + (f": {detail}" if detail else ""), flush=True)

    for dp, tp in [lt for lt in LAYOUTS if lt[0] * lt[1] == world]:
        for variant in VARIANTS:
            def check(dp=dp, tp=tp, v=variant):
                norms = layout_run(dp, tp, v, None, device)
                return f"grad norms {', '.join(f'{n:.6f}' for n in norms)}"
            report(f"layout dp={dp} tp={tp} {variant}", check)
            if tp > 1:  # parallel.sequence_parallel: NCCL's reduce-scatter along the sequence, the norms' grad sum
                def check_sp(dp=dp, tp=tp, v=variant):
                    norms = layout_run(dp, tp, v, None, device, True, True)
                    return f"grad norms {', '.join(f'{n:.6f}' for n in norms)}"
                report(f"layout dp={dp} tp={tp} {variant} sequence-parallel", check_sp)
    if args.bf16_sanity and world == 1:
        report("bf16 SFT sanity (tiny, autocast)", lambda: bf16_sanity("cuda" if cuda else "cpu"))
    backend = dist.get_backend() if dist.is_initialized() else "none (one process)"
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "device": str(device), "backend": backend, "checks": checks}, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
