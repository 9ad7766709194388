"""Which operations give a row different bits depending on the rest of the batch (batch invariance probe).

For each operation, one fixed row (or query) is computed alone and inside batches of other sizes / at
other positions / with other padding, and the number of configurations whose bits differ from the row
alone is printed. Run: PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/invariance_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.model import RMSNorm
from parallel.invariant import batch_invariant, inv_attention, inv_linear
from parallel.invariant import silu as invariant_silu


def report(name: str, outs: list[torch.Tensor]) -> None:
    ref = outs[0]
    bad = sum(not torch.equal(o, ref) for o in outs[1:])
    diff = max(float((o.float() - ref.float()).abs().max()) for o in outs)
    print(f"{name:58s} {bad:3d}/{len(outs) - 1:3d} differ   max|diff| {diff:.3g}")


def probe_linear(dtype, K=512, N=1536, ms=(1, 2, 3, 4, 7, 8, 16, 31, 64, 100, 257, 1024)):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g).to(dtype)
    row = torch.randn(1, K, generator=g).to(dtype)
    for fn, label in ((F.linear, "F.linear"), (inv_linear, "inv_linear")):
        outs = []
        for m in ms:
            x = torch.randn(m, K, generator=g).to(dtype)
            for pos in sorted({0, m - 1, m // 2}):
                x2 = x.clone()
                x2[pos] = row[0]
                outs.append(fn(x2, w)[pos])
        report(f"{label} [M,{K}]x[{K},{N}] {str(dtype)[6:]}: M in {ms[0]}..{ms[-1]}", outs)


def probe_rmsnorm(dtype, H=512, ms=(1, 2, 5, 64, 1000)):
    g = torch.Generator().manual_seed(1)
    row = torch.randn(H, generator=g).to(dtype)
    norm = RMSNorm(H, 1e-5, dtype=dtype)
    outs = []
    with torch.no_grad():
        for m in ms:
            x = torch.randn(m, H, generator=g).to(dtype)
            x[m // 2] = row
            outs.append(norm(x)[m // 2])
    report(f"RMSNorm (core.model) {str(dtype)[6:]}: M in {ms}", outs)


def probe_attention(dtype, hd=64, nh=4, P=37):
    """One query at position P-1 of a sequence: decode (1 query vs its KV cache: SDPA with 0..9 left-padding
    keys masked, the invariant op with 0..9 stale cache entries after the keys),
    and full causal forwards of the sequence extended by 0..60 later tokens."""
    g = torch.Generator().manual_seed(2)
    Lmax = P + 60
    q = torch.randn(1, nh, Lmax, hd, generator=g).to(dtype)
    k = torch.randn(1, nh, Lmax, hd, generator=g).to(dtype)
    v = torch.randn(1, nh, Lmax, hd, generator=g).to(dtype)
    for kind in ("sdpa", "inv"):
        outs = []
        for pad in range(0, 10, 3):  # decode: the query against its cache, `pad` padding keys in front
            kk = torch.cat([torch.zeros(1, nh, pad, hd, dtype=dtype), k[:, :, :P]], 2)
            vv = torch.cat([torch.zeros(1, nh, pad, hd, dtype=dtype), v[:, :, :P]], 2)
            valid = torch.arange(pad + P) >= pad
            if kind == "sdpa":
                o = F.scaled_dot_product_attention(q[:, :, P - 1:P], kk, vv, attn_mask=valid[None, None, None])
            else:  # the invariant cache keeps each key at its position; stale entries follow
                kk = torch.cat([k[:, :, :P], torch.randn(1, nh, pad, hd, generator=g).to(dtype)], 2)
                vv = torch.cat([v[:, :, :P], torch.randn(1, nh, pad, hd, generator=g).to(dtype)], 2)
                pos = torch.arange(P + pad)[None]
                seen = torch.ones(1, P + pad, dtype=torch.bool)
                o = inv_attention(q[:, :, P - 1:P], kk, vv, pos[:, P - 1:P], pos, seen)
            outs.append(o[0, :, 0])
        for extra in (0, 1, 5, 20, 60):  # full causal forward of P + extra tokens
            L = P + extra
            if kind == "sdpa":
                o = F.scaled_dot_product_attention(q[:, :, :L], k[:, :, :L], v[:, :, :L], is_causal=True)
            else:
                pos = torch.arange(L)[None]
                o = inv_attention(q[:, :, :L], k[:, :, :L], v[:, :, :L], pos, pos, torch.ones(1, L, dtype=torch.bool))
            outs.append(o[0, :, P - 1])
        report(f"{kind} attention {str(dtype)[6:]}: decode (pads 0,3,6,9) vs full (L=P+0..60)", outs)


def probe_sum(dtype, ms=(1, 2, 4, 64, 1000), n=50257):
    """The fused heads' per-token sum over the vocabulary (logsumexp) for chunks of M tokens."""
    g = torch.Generator().manual_seed(3)
    row = torch.randn(n, generator=g).to(dtype)
    outs = []
    for m in ms:
        x = torch.randn(m, n, generator=g).to(dtype)
        x[m // 2] = row
        outs.append(torch.logsumexp(x.float(), -1)[m // 2])
    report(f"logsumexp over a vocab row {str(dtype)[6:]}: M in {ms}", outs)


def probe_attention_rows(hd=64, n=256, batch=64, ms=(1, 2, 3, 4, 5, 7, 8)):
    """The attention's batched [M, hd] @ [hd, n] score and value products (fp32, the compute dtype): a query
    row computed in a tile of M rows against the same row inside a 128-row tile (a full forward's). Per M,
    whether any row differs: ATTN_ROW_BLOCK is the smallest M from which none does."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch, 128, hd, generator=g)
    for k_cols in (n, 64):  # the scores against n keys; a key block's values (KEY_BLOCK x hd)
        k = torch.randn(batch, hd, k_cols, generator=g)
        full = torch.matmul(q, k)
        same = [all(torch.equal(torch.matmul(q[:, s:s + m].contiguous(), k), full[:, s:s + m]) for s in (0, 8, 64, 120))
                for m in ms]
        print(f"{f'attention bmm [M,{hd}]x[{hd},{k_cols}] fp32: M in {ms}':58s} "
              f"bits differ at M = {[m for m, ok in zip(ms, same) if not ok]}")


def probe_silu(dtype, width=16, rows=(2, 3, 4, 5), trials=50):
    """A pointwise op on [M, width] rows: the last row of M = 3 or 5 falls in ATen's scalar tail."""
    g = torch.Generator().manual_seed(4)
    for fn, label in ((F.silu, "F.silu"), (invariant_silu, "invariant silu")):
        bad = 0
        with batch_invariant(True):
            for _ in range(trials):
                row = (torch.rand(width, generator=g) * 4).to(dtype)
                outs = [fn(row[None].repeat(m, 1))[m - 1] for m in rows]
                bad += sum(not torch.equal(o, outs[0]) for o in outs[1:])
        print(f"{label + f' [M,{width}] ' + str(dtype)[6:] + f': last row, M in {rows}':58s} "
              f"{bad:3d}/{trials * (len(rows) - 1):3d} differ")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for dt in (torch.float32, torch.bfloat16):
        probe_linear(dt)
        probe_rmsnorm(dt)
        probe_attention(dt)
        probe_sum(dt)
        probe_silu(dt)
    probe_attention_rows()
