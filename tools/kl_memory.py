"""What the policy-vs-reference KL term costs: peak memory, time and communication of six ways to
get target log-probs, entropy and the KL from hidden states and (sharded) LM-head weights.

    python -m tools.kl_memory --tokens T --hidden H --vocab V --tp N --dtype D --json OUT.json
        [--methods gather,vp_materialized,vp_chunked,fused_exact,fused_exact_loss,fused_k3] [--chunk-size C]
        [--pass forward|forward+backward|both] [--seed S]

| method          | mode  | what it does (per TP rank; the head weights are sharded [Vp/tp, H])        |
|-----------------|-------|---------------------------------------------------------------------------|
| gather          | exact | local logits, all-gather to [T, V], torch log_softmax, exact KL (most trainers) |
| vp_materialized | exact | local logits [T, Vp/tp] kept; parallel/vocab.py functions, no chunking     |
| vp_chunked      | exact | the same with chunk_size tokens at a time                                  |
| fused           | exact | parallel/fused.py: no logits tensor, chunked, recomputed in backward       |
| fused_loss      | exact | parallel/fused_loss.py: the loss inside, gradient formed in forward         |
| fused           | k3    | fused head for log p and log q of the sampled tokens only, then k3         |

Every method produces log p(target) and, for "exact", the entropy and KL(p||q) over the full
vocabulary; the reference (hidden and head) is frozen and has its own hidden states. Pass
"forward" runs under no_grad (scoring); "forward+backward" backpropagates a fixed linear loss of
the outputs into the policy hidden states and head weight (fused_exact_loss: the same linear loss,
given as its token_loss, differentiated inside the call).

tp > 1 is real: the tool spawns `tp` gloo ranks on this machine (hidden replicated, wrapped in
copy_to_tp; head weights sharded by rows), and each row reports the largest peak and time over
the ranks and rank 0's communication (every rank sends the same amount).

Row fields: method, pass, mode, tokens, hidden, vocab, tp, dtype, peak_bytes, time_s,
comm_bytes, comm_calls, chunk_size. peak_bytes is the peak of tensor memory allocated inside the
measured pass (MemTracker; the inputs, allocated before, are not counted; the gradients produced
are). time_s is one run's wall time with the tracker active. comm_bytes is the payload this rank
contributes to collectives (parallel.comm.count_comm), including copy_to_tp's backward all-reduce.
The JSON file holds a list of rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

from core.config import ModelConfig
from parallel import comm
from parallel.fused import fused_head
from parallel.fused_loss import fused_head_loss
from parallel.vocab import vocab_parallel_entropy, vocab_parallel_kl, vocab_parallel_logprobs

METHODS = {  # name -> (method, mode)
    "gather": ("gather", "exact"),
    "vp_materialized": ("vp_materialized", "exact"),
    "vp_chunked": ("vp_chunked", "exact"),
    "fused_exact": ("fused", "exact"),
    "fused_exact_loss": ("fused_loss", "exact"),
    "fused_k3": ("fused", "k3"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(T, H, V, tp, rank, dtype, seed, grad):
    """This rank's policy/reference hidden states (replicated) and head shards, targets, coefficients."""
    Vp = ModelConfig(vocab_size=V).padded_vocab_size(tp)
    width = Vp // tp
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_(grad)
    hr = torch.randn(T, H, generator=g).to(dtype)
    g_w = torch.Generator().manual_seed(seed + 1 + rank)  # each rank's own rows of the heads
    w = (torch.randn(width, H, generator=g_w) * H**-0.5 * 2).to(dtype).requires_grad_(grad)
    wr = (w.detach().float() + torch.randn(width, H, generator=g_w) * H**-0.5 * 0.3).to(dtype)
    t = torch.randint(0, V, (T,), generator=g)
    coef = torch.randn(3, T, generator=g)
    return h, w, hr, wr, t, coef


def _linear_loss(outs, coef):
    return sum((o.float() * c).sum() for o, c in zip(outs, coef) if o is not None)


def _outputs(name, h, w, hr, wr, t, group, V, chunk, coef):
    """((log p(t), entropy or None, KL-ish term), the loss to backpropagate) for one method."""
    hp = comm.copy_to_tp(h, group)  # replicated hidden: backward sums the ranks' partial grads
    if name == "fused_exact_loss":  # the same linear loss, per chunk of tokens `s`
        token_loss = lambda lp, ent, kl, s: lp.float() * coef[0][s] + ent.float() * coef[1][s] + kl.float() * coef[2][s]
        loss, out = fused_head_loss(hp, w, t, group, vocab_size=V, ref_hidden=hr, ref_weight_local=wr,
                                    chunk_size=chunk, entropy=True, kl="forward", token_loss=token_loss)
        return (out.logprobs, out.entropy, out.kl), loss
    outs = _method_outputs(name, hp, w, hr, wr, t, group, V, chunk)
    return outs, _linear_loss(outs, coef)


def _method_outputs(name, hp, w, hr, wr, t, group, V, chunk):
    if name == "gather":
        zp = comm.gather_from_tp(hp @ w.T, group)[:, :V].float()  # [T, Vp] gathered, padding dropped
        zq = comm.gather_from_tp(hr @ wr.T, group)[:, :V].float()
        logp, logq = torch.log_softmax(zp, -1), torch.log_softmax(zq, -1)
        p = logp.exp()
        return (logp.gather(1, t[:, None])[:, 0], -(p * logp).sum(-1), (p * (logp - logq)).sum(-1))
    if name in ("vp_materialized", "vp_chunked"):
        c = chunk if name == "vp_chunked" else None
        zp, zq = hp @ w.T, hr @ wr.T  # [T, Vp/tp] each, sharded on the vocabulary
        kw = dict(vocab_size=V, chunk_size=c)
        return (vocab_parallel_logprobs(zp, t, group, **kw), vocab_parallel_entropy(zp, group, **kw),
                vocab_parallel_kl(zp, zq, group, **kw))
    if name == "fused_exact":
        out = fused_head(hp, w, t, group, vocab_size=V, ref_hidden=hr, ref_weight_local=wr, chunk_size=chunk,
                         entropy=True, kl="forward")
        return out.logprobs, out.entropy, out.kl
    out = fused_head(hp, w, t, group, vocab_size=V, ref_hidden=hr, ref_weight_local=wr, chunk_size=chunk,
                     entropy=False, kl=None)
    log_ratio = out.ref_logprobs - out.logprobs  # k3 = r - 1 - log r, r = q(t)/p(t)
    return out.logprobs, None, torch.expm1(log_ratio) - log_ratio


def _total(snapshot) -> int:
    return int(sum(d["Total"] for d in snapshot.values()))


def measure(name, pass_, T, H, V, dtype, chunk, group=None, seed=0) -> dict:
    """One row: run `name` once (forward, or forward+backward) and measure it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tp, rank = comm.group_size(group), comm.group_rank(group)
    backward = pass_ == "forward+backward"
    h, w, hr, wr, t, coef = _inputs(T, H, V, tp, rank, DTYPES[dtype], seed, backward)
    gc.collect()
    tracker = MemTracker()
    tracker.track_external(h, w, hr, wr, t, coef)  # known from the start, so views of them are not new
    with comm.count_comm() as counter, tracker:
        base = _total(tracker.get_tracker_snapshot("current"))
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            outs, loss = _outputs(name, h, w, hr, wr, t, group, V, chunk, coef)
        if backward:
            loss.backward()
        elapsed = time.perf_counter() - start
    del outs, loss
    snap = tracker.get_tracker_snapshot("peak")  # peak over the pass, inputs included
    method, mode = METHODS[name]
    return dict(method=method, name=name, mode=mode, tokens=T, hidden=H, vocab=V, tp=tp, dtype=dtype,
                chunk_size=chunk if name != "gather" and name != "vp_materialized" else None,
                peak_bytes=_total(snap) - base,
                time_s=round(elapsed, 4), comm_bytes=counter.bytes, comm_calls=counter.calls,
                **{"pass": pass_})


def run_all(names, passes, T, H, V, dtype, chunk, group=None, seed=0, log=None) -> list[dict]:
    rows = []
    for pass_ in passes:
        for name in names:
            row = measure(name, pass_, T, H, V, dtype, chunk, group, seed)
            rows.append(row)
            gc.collect()
            if log:
                log(row)
    return rows


def _rank_main(rank, tp, port, args, seed, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    try:
        queue.put((rank, run_all(*args, group=dist.group.WORLD, seed=seed)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        queue.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned(tp, names, passes, T, H, V, dtype, chunk, seed=0) -> list[dict]:
    """Run on `tp` gloo ranks; merge rows: max peak and time over ranks, rank 0's communication."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    args = (names, passes, T, H, V, dtype, chunk)
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, args, seed, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get() for _ in range(tp))
    for p in procs:
        p.join()
    bad = {r: v for r, v in per_rank.items() if isinstance(v, str)}
    if bad or any(p.exitcode for p in procs):
        raise RuntimeError(f"kl_memory failed on ranks {sorted(bad)}: {bad}")
    rows = per_rank[0]
    for i, row in enumerate(rows):
        row["peak_bytes"] = max(per_rank[r][i]["peak_bytes"] for r in range(tp))
        row["time_s"] = max(per_rank[r][i]["time_s"] for r in range(tp))
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m tools.kl_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--json", required=True, help="output file: a JSON list of rows")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {list(METHODS)}")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--pass", dest="pass_", choices=["forward", "forward+backward", "both"],
                    default="forward+backward")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    for k in ("tokens", "hidden", "vocab", "tp", "chunk_size"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be positive, got {getattr(a, k)}")
    passes = ["forward", "forward+backward"] if a.pass_ == "both" else [a.pass_]
    log = lambda r: print(f"{r['name']:>16} {r['pass']:>16}  peak {r['peak_bytes'] / 2**20:10.1f} MiB  "
                          f"time {r['time_s']:8.3f} s  comm {r['comm_bytes']} B", file=sys.stderr, flush=True)
    args = (names, passes, a.tokens, a.hidden, a.vocab, a.dtype, a.chunk_size)
    rows = run_all(*args, seed=a.seed, log=log) if a.tp == 1 else run_spawned(a.tp, *args, seed=a.seed)
    tmp = a.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, a.json)  # never leave a half-written file where a good one was
    return rows


if __name__ == "__main__":
    main()
