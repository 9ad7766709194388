"""Context parallelism against one rank: the GRPO update's forward + backward (the fused loss head,
rl/update/logprobs.py's `policy_fused_loss`) over one long response, per-rank peak memory and time,
cp = 1 and cp = 2 (ring and Ulysses) side by side in one run.

    python -m bench.bench_cp [--tokens 1024 4096 8192] [--impl ring ulysses] [--hidden 64] [--layers 2]
        [--vocab 256] [--chunk 256] [--repeats 2] [--device cpu] [--json OUT]

Two ranks are started here (gloo on CPU, nccl on CUDA: one GPU each); cp = 2 runs on both, then cp = 1 on
rank 0 alone while rank 1 waits. Each row: one sequence of `--tokens` tokens (a prompt of 16, the rest the
response), every response token in the loss (a clipped GRPO surrogate with random advantages), fp32.
Peak: CPU, tensor bytes tracked by torch.distributed._tools.mem_tracker.MemTracker above the model and the
batch (deterministic); CUDA, max_memory_allocated above what was allocated before. Time: the median of
`--repeats` after one warm-up (on a shared CPU machine read the ratio, not the seconds). The model is tiny
(hidden `--hidden`): its activations, which is what cp splits, are what the peak measures; the fused head
runs in chunks of `--chunk` tokens (algo.kl_chunk_size), whose [chunk, V] buffers are a per-rank constant
that cp does not split (the tiny head's automatic chunk would be 8192 tokens, the whole of a cp rank's
8k tokens at 16k).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.config import ModelConfig
from core.model import build_model
from parallel.context import ContextParallel
from rl.update.logprobs import policy_fused_loss

PROMPT = 16


def _config(args, tokens: int) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                       intermediate_size=2 * args.hidden, max_seq_len=tokens)


def _token_loss(adv: torch.Tensor, w: float):
    def loss(logp, entropy, kl, tokens):
        ratio = torch.exp(logp - logp.detach())
        a = adv[tokens].to(logp.dtype)
        return w * -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    return loss


def update_peak(tokens: int, cp_group=None, impl: str = "ring", device="cpu", hidden: int = 64, layers: int = 2,
                vocab: int = 256, repeats: int = 1, measure_memory: bool = True, chunk: int = 256) -> dict:
    """Peak bytes and time of one forward + backward of the fused GRPO loss over one sequence of `tokens`,
    on this rank (cp_group None: cp = 1); the fused head in chunks of `chunk` tokens."""
    args = argparse.Namespace(hidden=hidden, layers=layers, vocab=vocab)
    cfg = _config(args, tokens)
    device = torch.device(device)
    model = build_model(cfg, seed=3, device=device)
    if cp_group is not None:
        model.context_parallel = ContextParallel(cp_group, impl)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    N = tokens - PROMPT
    mask = torch.ones(1, N, dtype=torch.bool, device=device)
    adv = torch.randn(N, generator=g).to(device)
    token_loss = _token_loss(adv, 1.0 / N)

    def step():
        loss, _ = policy_fused_loss(model, seq, None, PROMPT, token_loss, vocab_size=vocab, mask=mask,
                                    chunk_size=chunk)
        loss.backward()
        model.zero_grad(set_to_none=False)

    step()  # warm-up: gradients allocated, so the peak below is the activations'
    peak = None
    if measure_memory:
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            total = lambda snap: sum(d["Total"] for d in snap.values())  # noqa: E731
            mt = MemTracker()
            mt.track_external(model, seq, mask, adv)
            with mt:
                base = total(mt.get_tracker_snapshot("current"))
                step()
            peak = total(mt.get_tracker_snapshot("peak")) - base
    times = []
    for _ in range(repeats):
        if cp_group is not None:
            dist.barrier(group=cp_group)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return dict(tokens=tokens, cp=1 if cp_group is None else dist.get_world_size(cp_group), impl=impl,
                peak_bytes=peak, time_s=statistics.median(times) if times else None)


def _rank(rank: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=1800))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    group = dist.new_group([0, 1])
    rows = []
    kw = dict(device=device, hidden=args.hidden, layers=args.layers, vocab=args.vocab, repeats=args.repeats,
              chunk=args.chunk)
    for T in args.tokens:
        for impl in args.impl:
            rows.append(update_peak(T, group, impl, **kw))
        dist.barrier()
        if rank == 0:
            rows.append(update_peak(T, None, **kw))
        dist.barrier()
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--impl", nargs="+", default=["ring", "ulysses"], choices=["ring", "ulysses"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=256, help="fused head tokens per chunk (algo.kl_chunk_size)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get()
    for p in procs:
        p.join()
    print(f"{'tokens':>7} {'layout':>13} {'peak/rank MiB':>14} {'x cp=1':>7} {'time s':>8} {'x cp=1':>7}")
    for T in args.tokens:
        base = next(r for r in rows if r["tokens"] == T and r["cp"] == 1)
        for r in (x for x in rows if x["tokens"] == T):
            name = "cp=1" if r["cp"] == 1 else f"cp=2 {r['impl']}"
            print(f"{T:>7} {name:>13} {r['peak_bytes'] / 2**20:>14.1f} {r['peak_bytes'] / base['peak_bytes']:>7.3f} "
                  f"{r['time_s']:>8.3f} {r['time_s'] / base['time_s']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
