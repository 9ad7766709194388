"""Ring attention (parallel/context.py's `cp_impl=ring`), forward and hand-written backward.

Each rank keeps its queries [B, nh_l, S/cp, hd] (chunks a0 = r and a1 = 2cp-1-r of the load-balanced
layout). The KV block of rank src (its chunks b0 = src, b1 = 2cp-1-src) reaches it at ring step
(r - src) mod cp; at every step each (query chunk a, key chunk b) pair is
  - skipped when b > a (every key later than every query),
  - attended in full when b < a (no document ids), or under the diagonal mask when b == a,
  - with documents, under the mask `visible` builds from global indices and document ids,
giving a partial output o_i and log-sum-exp l_i per query row, merged into the running pair (o, l):
l' = logaddexp(l, l_i), o' = o * exp(l - l') + o_i * exp(l_i - l'). The merged output equals
softmax attention over the whole sequence; the sums run in fp32 (fp64 inputs stay fp64).

Backward (the flash-attention form): with the merged output O and its log-sum-exp L saved,
D = rowsum(dO * O); for every block P = exp(S - L) (the final probabilities, no renormalising),
dV += P^T dO, dS = P * (dO V^T - D), dQ += dS K * scale, dK += dS^T Q * scale. The KV blocks travel
the ring again together with their dK, dV accumulators; after cp steps each accumulator has visited
every rank and one last hop hands it to the block's owner. Saved for backward: q, k, v, O and L
of this rank only (no other rank's KV block is kept).

GQA: the query heads of a KV head attend as one group ([B, nkv_l, g, S, hd] against [B, nkv_l, 1, S, hd]),
so KV blocks travel with their own nkv_l heads, never expanded.

Each block pair runs one of two kernels: on CPU without a document mask, PyTorch's flash kernel
(`_scaled_dot_product_flash_attention_for_cpu`, which returns the log-sum-exp, and its backward, given the
merged O and L); otherwise the math here, in query tiles of TILE_ELEMS / (S/(2cp)) rows (the scores
[B, nh_l, rows, S/(2cp)] of one tile at a time). CUDA runs the math path.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel.context_layout import balanced_index, visible

TILE_ELEMS = 2**16  # score elements per (batch row, head) of one query tile: the math path's transient memory
TILE_ELEMS_CUDA = 2**22  # on a GPU: fewer, larger tiles (16 MiB of fp32 scores per head)


class _Exchange:
    """`tensors` on their way to the next rank of the ring while the previous rank's arrive (same shapes);
    `wait()` returns what arrived. Started before a block's compute, waited after it: the transfer overlaps it."""

    def __init__(self, tensors: list[torch.Tensor], group, rank: int, n: int):
        nxt, prv = dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)
        self.sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        self.bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in self.sent]
        ops = [dist.P2POp(dist.isend, t, nxt) for t in self.sent] + [dist.P2POp(dist.irecv, b, prv) for b in self.bufs]
        self.reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for req in self.reqs:
            req.wait()
        return self.bufs


def _ring_exchange(tensors: list[torch.Tensor], group, rank: int, n: int) -> list[torch.Tensor]:
    """Send `tensors` to the next rank of the ring, receive the previous rank's (same shapes)."""
    return _Exchange(tensors, group, rank, n).wait()


def _safe(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isinf(lse), 0.0)  # a row with no visible key: p = exp(-inf) = 0, not nan


def _scores(q, k, mask, scale, i):
    s = (q @ k.transpose(-1, -2)) * scale  # (B, nkv, g, t, Sk)
    if isinstance(mask, str):  # "causal": the diagonal block (Sq == Sk)
        r = torch.arange(i, i + q.shape[-2], device=q.device)
        s = s.masked_fill(torch.arange(k.shape[-2], device=q.device)[None, :] > r[:, None], float("-inf"))
    elif mask is not None:
        s = s.masked_fill(~mask[:, None, None, i:i + q.shape[-2]], float("-inf"))
    return s


def _tile(Sk: int, device=None) -> int:
    elems = TILE_ELEMS_CUDA if device is not None and device.type == "cuda" else TILE_ELEMS
    return max(16, elems // max(Sk, 1))


def _flash(q, mask) -> bool:
    """The CPU flash kernel (out and log-sum-exp, and its backward) serves blocks without a document mask."""
    return q.device.type == "cpu" and (mask is None or isinstance(mask, str))


def _heads(q, k):
    """[B, nkv, g, S, d] / [B, nkv, 1, S, d] -> [B, nkv * g, S, d] each (KV heads expanded for the kernel)."""
    B, nkv, g, S, d = q.shape
    return q.reshape(B, nkv * g, S, d), k.expand(B, nkv, g, k.shape[-2], d).reshape(B, nkv * g, k.shape[-2], d)


def block_forward(q, k, v, mask, scale):
    """q [B, nkv, g, Sq, d], k, v [B, nkv, 1, Sk, d], mask: None (all visible), "causal" (the diagonal block) or
    bool [B|1, Sq, Sk] -> out [B, nkv, g, Sq, d], lse [B, nkv, g, Sq, 1] (-inf where a row sees no key; out 0)."""
    if _flash(q, mask):
        (qh, kh), (_, vh) = _heads(q, k), _heads(q, v)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, mask is not None,
                                                                            scale=scale)
        return o.view(q.shape), lse.view(q.shape[:-1] + (1,))
    outs, lses, t = [], [], _tile(k.shape[-2], q.device)
    for i in range(0, q.shape[-2], t):
        s = _scores(q[..., i:i + t, :], k, mask, scale, i)
        lse = torch.logsumexp(s, -1, keepdim=True)
        outs.append(torch.exp(s - _safe(lse)) @ v)
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -2)


def block_backward(q, k, v, out, lse, delta, dout, mask, scale):
    """Gradients of one block (see the module docstring) -> dq [like q], dk, dv [like k]. `out`, `lse`: the
    merged output and log-sum-exp of these query rows over the whole sequence."""
    if _flash(q, mask):
        (qh, kh), (_, vh) = _heads(q, k), _heads(q, v)
        B, nkv, g, Sq, d = q.shape
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.reshape(qh.shape), qh, kh, vh, out.reshape(qh.shape), lse.reshape(qh.shape[:-1]), 0.0,
            mask is not None, scale=scale)
        fold = lambda t: t.view(B, nkv, g, t.shape[-2], d).sum(2, keepdim=True)  # noqa: E731
        return dq.view(q.shape), fold(dk), fold(dv)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    t = _tile(k.shape[-2], q.device)
    for i in range(0, q.shape[-2], t):
        sl = slice(i, i + t)
        qt, dot = q[..., sl, :], dout[..., sl, :]
        p = torch.exp(_scores(qt, k, mask, scale, i) - _safe(lse[..., sl, :]))
        dv += (p.transpose(-1, -2) @ dot).sum(2, keepdim=True)
        ds = p * (dot @ v.transpose(-1, -2) - delta[..., sl, :])
        dq[..., sl, :] = (ds @ k) * scale
        dk += (ds.transpose(-1, -2) @ qt).sum(2, keepdim=True) * scale
    return dq, dk, dv


def _pairs(rank: int, src: int, n: int, c: int):
    """(query rows, key rows, query chunk, key chunk) of this rank's queries against src's keys, b <= a."""
    qs = ((slice(0, c), rank), (slice(c, 2 * c), 2 * n - 1 - rank))
    ks = ((slice(0, c), src), (slice(c, 2 * c), 2 * n - 1 - src))
    return [(qa, kb, a, b) for qa, a in qs for kb, b in ks if b <= a]


class _Ring:
    """What a ring pass needs to know: sizes, this rank's indices and documents, the masks."""

    def __init__(self, att, device):
        cp = att.cp
        self.group, self.n, self.rank = cp.group, cp.size, cp.rank
        self.S = att.seq_len
        self.c = self.S // (2 * self.n)
        self.q_idx = balanced_index(self.S, self.n, self.rank, device)
        self.doc, self.pre = att.document_ids, att.prefix_ids
        if self.doc is not None and self.pre is None:
            self.pre = self.doc

    def mask(self, qa, kb, a, b, src, k_doc):
        if self.doc is None:
            return None if b < a else "causal"
        k_idx = balanced_index(self.S, self.n, src, self.q_idx.device)
        return visible(self.q_idx[qa], k_idx[kb], self.doc[:, qa], k_doc[:, kb], self.pre[:, qa])


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, att):
        B, nh, L, d = q.shape
        nkv = k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        ring = _Ring(att, q.device)
        scale = 1.0 / math.sqrt(d)
        qg = q.to(acc).view(B, nkv, nh // nkv, L, d)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1] + (1,), float("-inf"), dtype=acc, device=q.device)
        k_cur, v_cur, doc_cur = k, v, ring.doc
        for step in range(ring.n):
            src = (ring.rank - step) % ring.n
            nxt = None
            if step < ring.n - 1:  # the next block is on its way while this one is computed
                nxt = _Exchange([k_cur, v_cur] + ([doc_cur] if doc_cur is not None else []), ring.group, ring.rank,
                                ring.n)
            kb, vb = k_cur.to(acc).unsqueeze(2), v_cur.to(acc).unsqueeze(2)
            for qa, kr, a, b in _pairs(ring.rank, src, ring.n, ring.c):
                o_i, l_i = block_forward(qg[..., qa, :], kb[..., kr, :], vb[..., kr, :],
                                         ring.mask(qa, kr, a, b, src, doc_cur), scale)
                l_old = lse[..., qa, :]
                l_new = torch.logaddexp(l_old, l_i)
                ls = _safe(l_new)
                out[..., qa, :] = out[..., qa, :] * torch.exp(l_old - ls) + o_i * torch.exp(l_i - ls)
                lse[..., qa, :] = l_new
            if nxt is not None:
                got = nxt.wait()
                k_cur, v_cur = got[0], got[1]
                doc_cur = got[2] if doc_cur is not None else None
        ctx.ring, ctx.scale = ring, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.view(B, nh, L, d).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        acc = out.dtype
        B, nh, L, d = q.shape
        nkv = k.shape[1]
        qg = q.to(acc).view(B, nkv, nh // nkv, L, d)
        do = dout.to(acc).view(qg.shape)
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qg)
        k_cur, v_cur, doc_cur = k, v, ring.doc
        dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device).unsqueeze(2)
        dv_acc = torch.zeros_like(dk_acc)
        for step in range(ring.n):
            src = (ring.rank - step) % ring.n
            nxt = None
            if step < ring.n - 1:  # the next KV block travels during this step's compute; the gradients after it
                nxt = _Exchange([k_cur, v_cur] + ([doc_cur] if doc_cur is not None else []), ring.group, ring.rank,
                                ring.n)
            kb, vb = k_cur.to(acc).unsqueeze(2), v_cur.to(acc).unsqueeze(2)
            for qa, kr, a, b in _pairs(ring.rank, src, ring.n, ring.c):
                dq_i, dk_i, dv_i = block_backward(qg[..., qa, :], kb[..., kr, :], vb[..., kr, :], out[..., qa, :],
                                                  lse[..., qa, :],
                                                  delta[..., qa, :], do[..., qa, :],
                                                  ring.mask(qa, kr, a, b, src, doc_cur), scale)
                dq[..., qa, :] += dq_i
                dk_acc[..., kr, :] += dk_i
                dv_acc[..., kr, :] += dv_i
            if ring.n == 1:
                break
            # the block's gradient accumulators follow it; after the last step they reach its owner
            dk_acc, dv_acc = _ring_exchange([dk_acc, dv_acc], ring.group, ring.rank, ring.n)
            if nxt is not None:
                got = nxt.wait()
                k_cur, v_cur = got[0], got[1]
                doc_cur = got[2] if doc_cur is not None else None
        return (dq.view(B, nh, L, d).to(q.dtype), dk_acc.squeeze(2).to(k.dtype), dv_acc.squeeze(2).to(v.dtype),
                None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, att) -> torch.Tensor:
    """Causal (or document-masked) attention of this rank's tokens over the whole sequence; see the module."""
    if q.shape[2] * att.cp.size != att.seq_len or q.shape[2] % 2:
        raise ValueError(f"ring attention: {q.shape[2]} local tokens x cp={att.cp.size} != sequence length "
                         f"{att.seq_len} (or odd: two chunks per rank)")
    return RingAttention.apply(q, k, v, att)
