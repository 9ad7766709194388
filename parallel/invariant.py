"""Batch-invariant operations: each token's result has the same bits whatever else is in the batch.

Used by the model, the TP layers and the fused heads while `batch_invariant(True)` is active
(`Transformer.batch_invariant`, config key `parallel.batch_invariant`). The rollout's decode-time
forward (one position at a time against a KV cache, a few rows) and the trainer's full forward
(thousands of rows, packed or padded or shared-prompt) then give a token the same hidden state,
logits and log-prob, bit for bit. What varies with the batch's shape, and how each is fixed here
(measured by scripts/invariance_probe.py, docs/design.md "Batch-invariant mode"):

  - matmuls: the BLAS picks its kernel by the number of rows M (fp32 CPU: gemv at M = 1, another
    kernel at M = 2..3, and the rows of a tail that a thread's share leaves differ again). `inv_linear`
    pads the rows to a multiple of ROW_BLOCK, so every row goes through the full-block kernel;
  - attention: SDPA splits the keys by the query and key lengths and the kernel, and the padding and
    packing offsets move a key's place in a vector lane. On CPU `inv_attention` runs a fused C++ kernel
    whose code fixes each query's order (parallel/invariant_kernel.py, parallel/csrc/); elsewhere, and
    where it cannot be built, plain PyTorch: `inv_attention` sums over the keys of a
    query's own sequence in their position order, in blocks of KEY_BLOCK positions from position 0,
    the blocks added one after another; keys past the query weigh exactly 0, so the total length
    and the number of queries do not matter; its batched products take the queries in tiles padded to a
    multiple of ATTN_ROW_BLOCK = 4 rows (the probe: 1-3 rows differ, 4 or more share the bits; the
    decode's one query per head pays 4x, not the linear layers' 8x); `canonical_layout` lays any batch
    (padded, packed, shared prompts) out so that a token's keys stand at their positions;
  - fp32 silu: ATen's vectorized and scalar-tail formulas round differently, and which rows fall in the
    tail depends on the tensor's size; `silu` pads the flat tensor to whole vectors;
  - the TP all-reduce of the row-parallel layers (ring order depends on the tensor's size):
    parallel/comm.py gathers the partial sums and adds them in rank order while the mode is on.

What is already invariant and left alone (same probe): RMSNorm's mean over the hidden size, the
per-token reductions over the vocabulary, the vocab-parallel max and the rank-ordered sums.

The invariance is the forward's; the attention's backward is standard attention's, taken from the
forward's own output and log-sum-exp (parallel/invariant_grad.py), not autograd through the blocks.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parallel import invariant_kernel
from parallel.invariant_grad import attention_backward, exact_forward, keys_seen, reference_attention

ROW_BLOCK = 8  # matmul rows are padded to a multiple of this (the BLAS's full-block kernel for every row)
ATTN_ROW_BLOCK = 4  # the attention's query tiles: [4+, 64] @ [64, n] rows share the kernel's bits (the probe)
KEY_BLOCK = 64  # attention sums keys in blocks of this many positions, from position 0
POINTWISE_BLOCK = 64  # elements: whole pairs of AVX-512 or AVX2 vectors, of bf16 or fp32 (no scalar tail)
QUERY_BLOCK = 128  # a full forward's queries in blocks of this many positions (skips the keys after them)

_state = threading.local()


def enabled() -> bool:
    """Whether the batch-invariant operations are active on this thread."""
    return getattr(_state, "on", False)


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """Switch the batch-invariant operations on (or off) inside the block; nests."""
    prev = enabled()
    _state.on = bool(on)
    try:
        yield
    finally:
        _state.on = prev


def pad_rows(x: torch.Tensor, multiple: int = ROW_BLOCK) -> torch.Tensor:
    """x [M, K] with zero rows appended up to a multiple of `multiple` rows (x itself when none)."""
    extra = -x.shape[0] % multiple
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def inv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with each row's bits independent of the number of rows: the rows, flattened, padded to a
    multiple of ROW_BLOCK (the bias is added after, elementwise)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    y = F.linear(pad_rows(flat), weight)[: flat.shape[0]]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, weight.shape[0])


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu; in the mode over a flat copy padded to a multiple of POINTWISE_BLOCK elements. ATen runs a
    pointwise op vectorized over whole pairs of vectors and the tail with the scalar formula, and fp32
    silu's two round differently (the probe): without the padding, a token's activations would depend on
    whether its row ends the tensor (the MLP's [M, I/tp] when M x I/tp is not a multiple of 32)."""
    if not enabled():
        return F.silu(x)
    flat = x.reshape(-1)
    extra = -flat.numel() % POINTWISE_BLOCK
    if extra:
        flat = torch.cat([flat, flat.new_zeros(extra)])
    return F.silu(flat)[: x.numel()].view(x.shape)


# ---------------------------------------------------------------------------------------------
# attention over a sequence's own keys, in position order


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the invariant attention computes in: fp32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _key_blocks(x: torch.Tensor, Lp: int, ct: torch.dtype) -> torch.Tensor:
    """The first Lp positions of x [B, h, L, hd] (Lp a multiple of KEY_BLOCK), contiguous in dtype ct,
    zeros past L: one copy (none when x is already that tensor)."""
    B, h, L, hd = x.shape
    if L == Lp and x.dtype == ct and x.is_contiguous():
        return x
    n = min(L, Lp)
    out = x.new_empty((B, h, Lp, hd), dtype=ct)
    out[:, :, :n].copy_(x[:, :, :n])
    if n < Lp:
        out[:, :, n:].zero_()
    return out


def _mask_bias(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where a key is seen, -inf where `hidden`: added to finite scores it gives masked_fill's values (and
    the broadcast add over the heads runs ~8x faster than the masked fill, CPU)."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))


def inv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                  k_pos: torch.Tensor, k_valid: torch.Tensor | None, length: int | None = None, lse: bool = False,
                  mask_bias=None):
    """Causal attention whose result for a query depends only on it and its sequence's keys.

    q [B, h, S, hd]; k, v [B, h, L, hd] with key j of row b at position j (`k_pos` [B, L] must be
    arange(L) where `k_valid` [B, L]; the canonical layouts guarantee it); q_pos [B, S]. A query at
    position p sees the valid keys at positions <= p. `length`: no query sees a key at or past it
    (a KV cache's filled length; k, v may then be the whole cache). In fp32 whatever the inputs'
    dtype (float64 inputs: float64).

    The queries are padded to whole tiles of ATTN_ROW_BLOCK (the matmuls' row count), the keys to whole
    blocks of KEY_BLOCK positions. The softmax max is exact in any order; the sums over keys (the
    normaliser and the weighted values) are taken per block (a fixed-shape reduction and a
    [rows, KEY_BLOCK] @ [KEY_BLOCK, hd] matmul) and the blocks added in order from position 0, up to
    the block holding position length - 1. A key past the query contributes an exact 0 to both sums
    (exp(-inf) = 0; x + 0 = x), so neither the total key length L (cache size, longest row) nor the
    number of queries S changes a bit of a query's result: tests/test_batch_invariant.py checks it for
    several block sizes.

    A KV cache at its capacity (contiguous, whole key blocks, in the compute dtype) is read in place:
    the scores against its blocks up to `length` (a view) and the block sums over them; anything else
    is copied once into whole blocks.

    `mask_bias`: (Lp, dtype) -> [B, 1, S, Lp], 0 where a query sees the key and -inf where not, in place
    of q_pos and k_valid (a decode step builds it once for all layers). On CPU, where the fused kernel
    runs (parallel/invariant_kernel.py), everything above after the contract is the kernel's: it reads
    q_pos, k_valid and length itself and `mask_bias` is not used.

    With `lse`: (y in the compute dtype, the log-sum-exp of each query's scaled scores [B, h, S], +inf
    for a query that sees nothing), what the attention's backward needs (parallel/invariant_grad.py)."""
    del k_pos  # the layout contract; kept in the signature so call sites state it
    B, h, S, hd = q.shape
    L = k.shape[2]
    n = L if length is None else min(length, L)
    if invariant_kernel.applies(q):  # fp32 on CPU: the fused kernel (parallel/csrc/invariant_attention.cpp)
        f32 = [t.float() for t in (q, k, v)]
        f32 = [t if t.stride(-1) == 1 else t.contiguous() for t in f32]
        y, lse_ = invariant_kernel.kernel()(*f32, q_pos, k_valid, n, 1.0 / math.sqrt(hd))
        return (y, lse_) if lse else y.to(q.dtype)
    nb = -(-n // KEY_BLOCK)  # the key blocks summed
    ct = compute_dtype(q.dtype)
    out_dtype = q.dtype
    whole = L % KEY_BLOCK == 0 and all(t.dtype == ct and t.is_contiguous() for t in (k, v))
    Lp = L if whole else nb * KEY_BLOCK
    # every matmul operand contiguous: ATen's batched matmul picks its path by the operands' strides too
    # (a KV cache's slice has the cache's stride), and the paths round differently (tp 4, fp32)
    kf, vf = _key_blocks(k, Lp, ct), _key_blocks(v, Lp, ct)
    if whole and nb * KEY_BLOCK < L:  # a cache in place: the scores against its filled blocks only, a view
        Lp = nb * KEY_BLOCK  # (a batch stride of the cache's: the same bits in tests/test_batch_invariant.py,
        kf = kf[:, :, :Lp]  # tp 1/2/4, fp32 and bf16)
    Sp = S + (-S % ATTN_ROW_BLOCK)
    if Sp == S:
        qf = q.to(ct) * (1.0 / math.sqrt(hd))
    else:  # the query tile with zero padding rows
        qf = q.new_zeros((B, h, Sp, hd), dtype=ct)
        torch.mul(q.to(ct), 1.0 / math.sqrt(hd), out=qf[:, :, :S])
    if mask_bias is not None:  # the caller's mask for these Lp keys (a decode step's: one for every layer)
        bias = mask_bias(Lp, ct)
    else:
        if Lp != L:
            k_valid = (k_valid[:, :Lp] if L > Lp else
                       torch.cat([k_valid, k_valid.new_zeros(B, Lp - L)], 1))
        bias = _mask_bias(~keys_seen(q_pos, k_valid, Lp)[:, None], ct)  # (B, 1, S, Lp)
    # the matmuls take whole tiles of rows; a row's result does not depend on the others', so the
    # pointwise steps run on the S real rows only and the padding rows of the value matmul are zeros
    s = torch.matmul(qf.contiguous(), kf.transpose(-1, -2))[:, :, :S]  # (B, h, S, Lp): a dot product of hd each
    s.add_(bias)  # + 0 or -inf: the masked fill's values, in one fast broadcast add
    m = s.amax(-1, keepdim=True)  # a max is exact in any order
    m.masked_fill_(m == float("-inf"), 0.0)  # a query that sees nothing: all weights 0
    e = s.sub_(m).exp_().reshape(B, h, S, Lp // KEY_BLOCK, KEY_BLOCK)[:, :, :, :nb]  # exactly 0 where not seen
    dens = e.sum(-1, keepdim=True)  # (B, h, S, nb, 1): each block's normaliser, a fixed-size sum
    if Sp == S:  # each block's weights [S, KEY_BLOCK] read in place (rows Lp apart: no copy of the scores)
        eb = e.transpose(2, 3)
    else:  # as a whole tile of rows, the padding rows zeros
        eb = e.new_zeros(B, h, nb, Sp, KEY_BLOCK)
        eb[:, :, :, :S] = e.transpose(2, 3)
    # each block's [Sp, KEY_BLOCK] @ [KEY_BLOCK, hd], the values read in place (a view with the cache's or
    # the key blocks' batch stride: a contiguous copy of each block had cost as much as the matmuls; the
    # bits are the same)
    nums = [torch.matmul(eb[:, :, i], vf[:, :, i * KEY_BLOCK:(i + 1) * KEY_BLOCK]) for i in range(nb)]
    den = dens[:, :, :, 0].clone()
    num = nums[0][:, :, :S].clone()
    for i in range(1, nb):  # in position order: the same additions for every layout (a sum over the block
        den.add_(dens[:, :, :, i])  # dimension would not fix their order)
        num.add_(nums[i][:, :, :S])
    # a query that sees a key has den >= 1 (its largest score's weight is exp(0) = 1); one that sees none, 0
    y = num.div_(den.clamp(min=1.0))
    if lse:
        return y, torch.where(den > 0, m + torch.log(den), torch.full_like(den, float("inf"))).squeeze(-1)
    return y.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# layouts: every token's keys at their positions


@dataclass
class CanonicalLayout:
    """A batch [B, S] re-laid as D sequences [D, Lc], token at column = its position.

    gather [D, Lc]: flat index (into B*S) of the token at that position of sequence d, -1 where none
    (a shared-prompt response's sequence holds its prompt's tokens, then its own). own_seq, own_col
    [n]: for each real token (flat index own_tok [n]) the sequence and column whose query output it
    takes."""

    gather: torch.Tensor
    own_tok: torch.Tensor
    own_seq: torch.Tensor
    own_col: torch.Tensor
    shape: tuple  # (B, S)

    @property
    def valid(self) -> torch.Tensor:
        return self.gather >= 0

    def to_canonical(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, h, S, hd] -> [D, h, Lc, hd] (zeros where no token)."""
        B, h, S, hd = x.shape
        flat = x.transpose(1, 2).reshape(B * S, h, hd)
        g = self.gather
        out = flat[g.clamp(min=0).reshape(-1)].view(*g.shape, h, hd)  # a new tensor: filled in place
        out.masked_fill_(~self.valid[:, :, None, None], 0.0)
        return out.transpose(1, 2)

    def from_canonical(self, y: torch.Tensor) -> torch.Tensor:
        """y [D, h, Lc, hd] -> [B, h, S, hd]: each real token's own output, 0 on padding."""
        B, S = self.shape
        D, h, Lc, hd = y.shape
        vals = y.transpose(1, 2)[self.own_seq, self.own_col]  # (n, h, hd)
        out = y.new_zeros(B * S, h, hd).index_put_((self.own_tok,), vals)
        return out.view(B, S, h, hd).transpose(1, 2)

    def attend(self, q, k, v) -> torch.Tensor:
        """Attention of physical q [B, nh, S, hd] over k, v [B, nkv, S, hd] through the canonical layout.
        Its backward is standard attention's, from the forward's own output and log-sum-exp
        (parallel/invariant_grad.py's `attention_backward`)."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _CanonicalAttention.apply(self, q, k, v)
        y, _ = self.attend_canonical(*(self.to_canonical(t) for t in (q, k, v)))
        return self.from_canonical(y.to(q.dtype))

    def positions(self, device) -> torch.Tensor:
        """[D, Lc]: a canonical sequence's column is its position."""
        D, Lc = self.gather.shape
        return torch.arange(Lc, device=device).expand(D, Lc)

    def attend_canonical(self, qc, kc, vc):
        """The invariant attention over canonical qc [D, nh, Lc, hd], kc, vc [D, nkv, Lc, hd] -> (y in the
        compute dtype, lse [D, nh, Lc]). With the CPU kernel: one call over every query. Otherwise the keys
        and values are copied once into whole key blocks; each
        block of QUERY_BLOCK queries reads them up to its end only (a view, as a decode step reads its
        cache: the same bits)."""
        D, Lc = self.gather.shape
        pos = self.positions(qc.device)
        if invariant_kernel.applies(qc):  # the kernel: every query in one call, each reading its keys only
            return grouped_attention(qc, kc, vc, pos, self.valid, Lc, lse=True)
        ct = compute_dtype(qc.dtype)
        Lp = key_capacity(Lc)
        kf, vf = _key_blocks(kc, Lp, ct), _key_blocks(vc, Lp, ct)
        valid = self.valid if Lp == Lc else torch.cat([self.valid, self.valid.new_zeros(D, Lp - Lc)], 1)
        ys, ls = [], []
        for a in range(0, Lc, QUERY_BLOCK):  # causal: a block of queries reads the keys up to its end only
            e = min(a + QUERY_BLOCK, Lc)
            qb = qc[:, :, a:e].contiguous()  # the operands laid out as a full forward's (no strided slices)
            y, lse = grouped_attention(qb, kf, vf, pos[:, a:e], valid, e, lse=True)
            ys.append(y)
            ls.append(lse)
        return (torch.cat(ys, 2), torch.cat(ls, 2)) if len(ys) > 1 else (ys[0], ls[0])

    def canonical_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The adjoint of `from_canonical`: grad [B, h, S, hd] -> [D, h, Lc, hd], each real token's
        gradient at the canonical place its output came from, 0 elsewhere."""
        B, h, S, hd = grad.shape
        D, Lc = self.gather.shape
        flat = grad.transpose(1, 2).reshape(B * S, h, hd)
        out = grad.new_zeros(D, Lc, h, hd).index_put_((self.own_seq, self.own_col), flat[self.own_tok], accumulate=True)
        return out.transpose(1, 2)

    def physical_grad(self, grad_c: torch.Tensor) -> torch.Tensor:
        """The adjoint of `to_canonical`: grad_c [D, h, Lc, hd] -> [B, h, S, hd], a token's gradient the sum
        over every canonical place it stands (a shared prompt's keys stand in each of its responses')."""
        B, S = self.shape
        h, hd = grad_c.shape[1], grad_c.shape[3]
        valid = self.valid
        out = grad_c.new_zeros(B * S, h, hd).index_add_(0, self.gather[valid], grad_c.transpose(1, 2)[valid])
        return out.view(B, S, h, hd).transpose(1, 2)


class _CanonicalAttention(torch.autograd.Function):
    """The canonical layout's invariant attention; backward: standard attention's gradient from the saved
    output and log-sum-exp (no recomputation of the forward), mapped back through the layout."""

    @staticmethod
    def forward(ctx, layout, q, k, v):
        qc, kc, vc = (layout.to_canonical(t) for t in (q, k, v))
        y, lse = layout.attend_canonical(qc, kc, vc)
        ctx.layout = layout
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(qc, kc, vc, y, lse)
        return layout.from_canonical(y.to(q.dtype))

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        qc, kc, vc, y, lse = ctx.saved_tensors
        ct = y.dtype
        gy = layout.canonical_grad(grad.to(ct))
        grads = attention_backward(gy, qc.to(ct), kc.to(ct), vc.to(ct), y, lse, layout.positions(y.device),
                                   layout.valid)
        need = ctx.needs_input_grad[1:]
        return None, *(layout.physical_grad(g).to(dt) if n else None for g, dt, n in zip(grads, ctx.dtypes, need))


def canonical_layout(position_ids: torch.Tensor, valid: torch.Tensor, document_ids: torch.Tensor | None = None,
                     prefix_ids: torch.Tensor | None = None) -> CanonicalLayout:
    """The canonical layout of a batch [B, S]: `valid` marks real tokens; a sequence is a row (no
    document_ids) or one document of a row (document ids < 0: padding); with prefix_ids, a document
    whose tokens carry another document's id there also holds that document's tokens (its prompt).
    Positions must number each sequence's tokens 0, 1, ... (the prompt's first)."""
    B, S = position_ids.shape
    dev = position_ids.device
    rows = torch.arange(B, device=dev)[:, None].expand(B, S)
    if document_ids is None:
        doc = torch.zeros_like(position_ids)
    else:
        doc = document_ids
        valid = valid & (document_ids >= 0)
    key = (rows * (int(doc.max()) + 2 if doc.numel() else 1) + doc).reshape(-1)
    tok = valid.reshape(-1).nonzero()[:, 0]  # (n,) flat indices of real tokens
    seq_keys, seq_of = torch.unique(key[tok], return_inverse=True)  # (D,), (n,)
    pos = position_ids.reshape(-1)[tok].long()
    D = seq_keys.numel()
    Lc = int(pos.max()) + 1 if tok.numel() else 1
    gather = torch.full((D, Lc), -1, dtype=torch.long, device=dev)
    gather[seq_of, pos] = tok
    if prefix_ids is not None and tok.numel():
        pre_key = (rows * (int(doc.max()) + 2) + prefix_ids).reshape(-1)[tok]
        first = torch.full((D,), tok.numel(), dtype=torch.long, device=dev).scatter_reduce(
            0, seq_of, torch.arange(tok.numel(), device=dev), "amin")
        seq_pre = pre_key[first]  # (D,) each sequence's prompt key
        borrow = (seq_pre[:, None] == key[tok][None, :]) & (seq_pre[:, None] != seq_keys[:, None])  # (D, n)
        d, u = borrow.nonzero(as_tuple=True)
        gather[d, pos[u]] = tok[u]
        gather, seq_of = _drop_lent(gather, seq_of, d, seq_of[u])
    return CanonicalLayout(gather, tok, seq_of, pos, (B, S))


def _drop_lent(gather: torch.Tensor, seq_of: torch.Tensor, borrower: torch.Tensor, lender: torch.Tensor):
    """Without the sequences whose every token stands in another sequence at the same position (a shared
    prompt, lent whole to its responses, `borrower[i]` holding a token of `lender[i]`): such a token takes
    its output from a borrower's row, where its query meets the same keys (the prompt's, positions 0..p)
    and so gives the same bits; its own row would cost a whole [Lc] row of attention for a prompt's few
    tokens (one row per prompt besides its responses: 2x the attention at one response per row)."""
    D = gather.shape[0]
    host = torch.full((D,), -1, dtype=torch.long, device=gather.device)
    host.scatter_reduce_(0, lender, borrower, "amax")  # a borrower of each lent sequence
    borrows = torch.zeros(D, dtype=torch.bool, device=gather.device)
    borrows[borrower] = True
    drop = (host >= 0) & ~borrows  # a borrower's own row stays (it holds its own tokens)
    if not bool(drop.any()):
        return gather, seq_of
    keep = ~drop
    new_id = torch.cumsum(keep, 0) - 1
    seq_of = new_id[torch.where(drop[seq_of], host[seq_of], seq_of)]
    return gather[keep], seq_of



# ---------------------------------------------------------------------------------------------
# the model's entry points


@dataclass
class CachePositions:
    """With a KV cache: the new tokens' positions [B, S], which are real [B, S] and the cache's length
    after them (`length`: no query sees a key at or past it). Each real token's keys are written at
    its position (not its column), so a row's keys stand at positions 0, 1, ... whatever its left
    padding, as in the canonical layout."""

    pos: torch.Tensor
    valid: torch.Tensor
    length: int | None = None

    def __post_init__(self):
        # the real tokens' (row, column) and position, found once for all layers
        self.b, self.s = self.valid.nonzero(as_tuple=True)
        self.p = self.pos[self.b, self.s]
        self.every = self.b.numel() == self.valid.numel()  # every token real (a decode step's usual case)
        self._rows = {}  # (nkv, max_len) -> the written rows of a cache layer viewed [B * nkv * max_len, hd]
        self._masks = {}  # (g, Lp, dtype) -> each query row's mask bias (the same for every layer)

    def write(self, ck: torch.Tensor, cv: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, nkv, S, hd] into the cache's layers ck, cv [B, nkv, max_len, hd] at the real
        tokens' positions -> ck, cv themselves: inv_attention reads a cache sized by `key_capacity`
        in place (no copy of every layer's keys and values per step) and sums its key blocks up to
        `length` only. One row copy per cache (the rows' flat indices are found once for all layers)."""
        B, nkv, cap, hd = ck.shape
        rows = self._rows.get((nkv, cap))
        if rows is None:
            heads = torch.arange(nkv, device=ck.device)
            rows = ((self.b[:, None] * nkv + heads) * cap + self.p[:, None]).reshape(-1)  # (n * nkv,)
            self._rows[(nkv, cap)] = rows
        for cache, x in ((ck, k), (cv, v)):
            src = (x.transpose(1, 2) if self.every else x.transpose(1, 2)[self.b, self.s]).reshape(-1, hd)
            cache.view(-1, hd).index_copy_(0, rows, src.to(cache.dtype))
        return ck, cv

    def mask_bias(self, g: int, Lp: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, g * S, Lp]: -inf where a query row (head-major, as `grouped_attention` stacks them) does
        not see the key (its position is past the query's), else 0; built once per step for all layers."""
        bias = self._masks.get((g, Lp, dtype))
        if bias is None:
            bias = _mask_bias(~keys_seen(self.pos, None, Lp, g)[:, None], dtype)
            self._masks[(g, Lp, dtype)] = bias
        return bias


def key_capacity(length: int) -> int:
    """A KV cache's length for `length` positions in batch-invariant mode: rounded up to KEY_BLOCK."""
    return length + (-length % KEY_BLOCK)


def invariant_layout(input_ids, position_ids, attention_mask, past: int | None, document_ids, prefix_ids):
    """The layout the batch-invariant attention reads: the new tokens' cache positions (`past` = the
    KV cache's length, None without a cache), else the canonical layout of the batch (padded rows,
    packed documents, shared prompts)."""
    B, S = input_ids.shape
    start = past or 0
    valid = (attention_mask[:, start:start + S].bool() if attention_mask is not None
             else torch.ones(B, S, dtype=torch.bool, device=input_ids.device))
    if past is not None:
        return CachePositions(position_ids, valid, past + S)
    return canonical_layout(position_ids, valid, document_ids, prefix_ids)


def invariant_attend(layout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, nh, S, hd] over k, v [B, nkv, L, hd] through `layout` (CanonicalLayout or
    CachePositions). Grouped heads as SDPA's enable_gqa (query head i reads KV head i // (nh / nkv))."""
    if isinstance(layout, CanonicalLayout):
        return layout.attend(q, k, v)
    pos, g = layout.pos, q.shape[1] // k.shape[1]

    def reference(q, k, v):
        seen = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)  # j <= position: written
        return reference_attention(q, k, v, pos, seen)

    return exact_forward(lambda q, k, v: grouped_attention(q, k, v, pos, None, layout.length,
                                                           mask_bias=lambda Lp, dt: layout.mask_bias(g, Lp, dt)),
                         reference, q, k, v)


def grouped_attention(q, k, v, q_pos: torch.Tensor, k_valid: torch.Tensor | None, length: int | None = None,
                      lse: bool = False, mask_bias=None):
    """inv_attention with the g = nh / nkv query heads that share a KV head stacked as rows of one
    matrix (their keys and values are read once, never repeated per head): q [B, nh, S, hd] -> rows
    [B, nkv, g * S, hd], row i * S + s the query at position q_pos[:, s] of head i of the group.
    With `lse`: (y [B, nh, S, hd] in the compute dtype, lse [B, nh, S]), as inv_attention's."""
    B, nh, S, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    rows = q.reshape(B, nkv, g * S, hd)
    y = inv_attention(rows, k, v, q_pos.repeat(1, g) if g > 1 else q_pos, None, k_valid, length, lse, mask_bias)
    if lse:
        return y[0].reshape(B, nh, S, hd), y[1].reshape(B, nh, S)
    return y.reshape(B, nh, S, hd)
