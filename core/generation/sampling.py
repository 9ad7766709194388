"""Layout-invariant sampling from vocabulary-sharded logits, at the cost of plain multinomial.

Exponential race (Gumbel-max in another form): with E_v ~ Exp(1) independent,
    argmax_v  z_v / T - log E_v    is distributed as softmax(z / T).
E_v = -log(1 - w_v) with w_v uniform from a counter-based 32-bit hash of (seed, step, row id,
position, GLOBAL vocabulary index), so any TP layout, DP layout or batch order draws the same token
for the same row. w is built so that it is fine-grained near 0, where E is small and decides the
winner. The hash runs on int32 with wrapping multiplies, in place in preallocated buffers, over
row chunks that fit in cache. `compile=True` prunes: one torch.compile'd loop bounds every score
from the float exponent of the hash alone (no logarithm) by blocks of 128 columns, and the exact
scores are computed only in the few blocks that can hold the winner; the same winner as eager.
Filters turn excluded columns into -inf logits (score +inf) before the race.

Each rank takes the arg-min of log E - z/T over its shard; one all-gather of (score, id), 2 numbers
per row and rank, picks the winner. Filters, each exact over the shards (applied in this order):
  vocab_limit  columns >= the tokenizer's vocabulary (and the model's padding) are never drawn
  top_k        the global k-th value from every rank's local top-k (k*tp numbers per row)
  top_p        nucleus: keep v iff the mass of tokens with larger logit is < top_p; the threshold is
               a radix select over float32 keys, 4 passes, each one [B, 256] all-reduce
  min_p        keep v iff p_v >= min_p * max p: needs only the global max (one [B] all-reduce)

Log-probs of the drawn token (`return_logprobs=True`, `sharded_token_logprob`): log mu(y) under the
distribution the race actually drew from, softmax(z / T) renormalised over the columns the filters
kept, and `tempered_logprob`: log pi_T(y) = log softmax(z / T)[y] over the whole vocabulary (the
trainer's quantity). Each is one max and one [B, 2] sum all-reduce over the shards, no logits
gathered; z / T is a division, as in the trainer's fused head, and the sums are float32, as there.
"""

from __future__ import annotations

import math

import torch

from parallel.comm import all_gather_along, all_reduce, group_rank, group_size

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B - 2**32, 0xC2B2AE35 - 2**32  # murmur3 finaliser constants as signed int32
_CHUNK_ELEMS = 1 << 17  # elements per row chunk: 512 KiB per float32 buffer, fits in L2


def _mix32(x):
    """A 32-bit integer finaliser on Python ints or int64 tensors holding values < 2**32 ([B] and [V] keys)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def row_keys(seed: int, step: int, row_ids: torch.Tensor, position: int) -> torch.Tensor:
    """[B] int32 key per (seed, step, row id, position)."""
    h = _mix32(_mix32(seed ^ 0x9E3779B9) ^ step)  # Python ints: the same bits as on int64 tensors
    h = _mix32(row_ids.to(torch.int64) ^ h)
    return _as_int32(_mix32(h ^ position))


def col_keys(vocab_ids: torch.Tensor) -> torch.Tensor:
    """[Vl] int32 key per global vocabulary id."""
    return _as_int32(_mix32(vocab_ids.to(torch.int64) ^ 0x5BD1E995))


_col_cache: dict = {}


def _col_keys_of(start: int, n: int, device) -> torch.Tensor:
    """`col_keys` of global ids start..start+n-1, kept between decode positions."""
    key = (start, n, str(device))
    if key not in _col_cache:
        if len(_col_cache) > 16:
            _col_cache.clear()
        _col_cache[key] = col_keys(torch.arange(start, start + n, device=device))
    return _col_cache[key]


def _race_chunk(z, rk, ck, inv_t: float, x, tmp, f):
    """Scores log E - z*inv_t [b, Vl] into f (smaller wins) for logits z [b, Vl], row keys rk [b, 1],
    column keys ck [1, Vl]; x, tmp: int32 scratch of z's shape. Pure elementwise: layout-invariant."""
    torch.bitwise_xor(rk, ck, out=x)
    torch.bitwise_right_shift(x, 16, out=tmp)
    x.bitwise_xor_(tmp.bitwise_and_(0xFFFF))  # x ^= x >>> 16
    x.mul_(_C1)  # wraps mod 2**32
    torch.bitwise_right_shift(x, 13, out=tmp)
    x.bitwise_xor_(tmp.bitwise_and_(0x7FFFF))  # x ^= x >>> 13
    x.mul_(_C2)
    x.bitwise_right_shift_(1).bitwise_and_(0x7FFFFFFF).bitwise_or_(1)  # odd k < 2**31, top 31 bits
    f.copy_(x)
    f.mul_(-(2.0**-31))  # -w, w = k 2**-31 in (0, 1), fine-grained near 0 where E is small
    f.log1p_().neg_()  # E = -log(1 - w) ~ Exp(1); w rounding to 1 gives E = inf (never wins)
    f.log_()
    return torch.sub(f, z, alpha=inv_t, out=f)


def _hash(rk, ck):
    """The 31-bit odd counter hash k of `_race_chunk` in functional form (int32, broadcast)."""
    x = rk ^ ck
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _C1
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * _C2
    return ((x >> 1) & 0x7FFFFFFF) | 1


def _block_bounds(z, rk, ck, inv_t: float):
    """Bounds on the race scores s = log E - z*inv_t of z [b, nb, blk] (rk [b, 1, 1], ck [1, nb, blk]) by
    blocks of blk columns, without a logarithm: (lo, hi) [b, nb], each block's min of a lower and of an
    upper bound on s. With kf = float(k) in [2^e, 2^(e+1)), w = kf 2^-31 and E = -log(1 - w) >= w,
    log E >= (e - 31) ln 2; for w <= 1/2 (e <= 29), E <= w / (1 - w) <= 2w, so log E < (e - 29) ln 2.
    Slack of 1e-3 + 2^-16 |z*inv_t| covers the exact path's rounding; -inf logits give +inf bounds."""
    e = (_hash(rk, ck).to(torch.float32).view(torch.int32) >> 23).to(torch.float32) - 127.0
    zt = z * inv_t
    z_hi = torch.maximum(zt * (1.0 + _SLACK), zt * (1.0 - _SLACK))  # >= zt
    z_lo = torch.minimum(zt * (1.0 + _SLACK), zt * (1.0 - _SLACK))  # <= zt
    lo = (e - 31.0) * _LN2 - 1e-3 - z_hi
    hi = torch.where(e <= 29.0, (e - 29.0) * _LN2 + 1e-3 - z_lo, float("inf"))
    return lo.amin(-1), hi.amin(-1)


_LN2, _SLACK = math.log(2.0), 2.0**-16
_BLK = 128  # columns per block of the pruned race
_PRUNE_MIN_COLS = 2048  # narrower shards: the exact race over every column (fewer small ops)
_compiled = {}
_buffers: dict = {}


def _buffer(name: str, shape, dtype, device) -> torch.Tensor:
    key = (name, tuple(shape), dtype, str(device))
    if key not in _buffers:
        if len(_buffers) > 32:
            _buffers.clear()
        _buffers[key] = torch.empty(shape, dtype=dtype, device=device)
    return _buffers[key]


def _race_exact(z: torch.Tensor, rk: torch.Tensor, ck: torch.Tensor, inv_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(score [b] float32, column [b]) of the race over every column of z [b, n] (rk [b], ck [n]): row
    chunks that stay in cache on CPU, one chunk on an accelerator (fewer kernel launches)."""
    B, Vl = z.shape
    rows = max(1, min(B, _CHUNK_ELEMS // max(Vl, 1))) if z.device.type == "cpu" else B
    x = _buffer("x", (rows, Vl), torch.int32, z.device)
    tmp = _buffer("tmp", (rows, Vl), torch.int32, z.device)
    f = _buffer("f", (rows, Vl), torch.float32, z.device)
    best = torch.empty(B, dtype=torch.float32, device=z.device)
    idx = torch.empty(B, dtype=torch.long, device=z.device)
    for r0 in range(0, B, rows):
        r1 = min(B, r0 + rows)
        n = r1 - r0
        s = _race_chunk(z[r0:r1], rk[r0:r1, None], ck[None, :], inv_t, x[:n], tmp[:n], f[:n])
        torch.min(s, dim=-1, out=(best[r0:r1], idx[r0:r1]))
    return best, idx


def race_argmin(z: torch.Tensor, rk: torch.Tensor, ck: torch.Tensor, inv_t: float,
                compile: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Local winner of the race over z [B, Vl] (-inf: never drawn), rk [B], ck [Vl]: (score [B] float32,
    local column [B]), the first column on ties. Eager: the exact scores of every column (`_race_exact`).
    `compile`: log-free bounds per block of `_BLK` columns in one torch.compile'd loop (`_block_bounds`),
    then the same exact scores (`_race_chunk`) only in the blocks whose lower bound reaches the row's
    smallest upper bound (about 4 of 250 per row at [256, 32000]): the same winner, a fraction of the logs."""
    if not compile or z.shape[1] < _PRUNE_MIN_COLS:
        return _race_exact(z, rk, ck, inv_t)
    fn = _compiled.get("bounds")
    if fn is None:  # shapes become dynamic on the first recompile (batch compaction changes B)
        fn = _compiled["bounds"] = torch.compile(_block_bounds)
    return _race_pruned(z, rk, ck, inv_t, fn)


def _race_pruned(z, rk, ck, inv_t: float, bounds) -> tuple[torch.Tensor, torch.Tensor]:
    """`race_argmin` through block bounds: `bounds` is `_block_bounds` or its compiled form."""
    B, Vl = z.shape
    nb = -(-Vl // _BLK)
    if nb * _BLK != Vl:  # pad to whole blocks with never-drawn columns
        z = torch.nn.functional.pad(z, (0, nb * _BLK - Vl), value=float("-inf"))
        ck = torch.nn.functional.pad(ck, (0, nb * _BLK - Vl))
    z3, ck3 = z.view(B, nb, _BLK), ck.view(1, nb, _BLK)
    lo, hi = bounds(z3, rk.view(B, 1, 1), ck3, inv_t)
    r, b = (lo <= hi.amin(-1, keepdim=True)).nonzero(as_tuple=True)  # candidate (row, block) pairs
    n = r.numel()
    x, tmp = (torch.empty(n, _BLK, dtype=torch.int32, device=z.device) for _ in range(2))
    s = _race_chunk(z3[r, b], rk[r, None], ck3[0, b], inv_t, x, tmp,
                    torch.empty(n, _BLK, dtype=torch.float32, device=z.device))
    bs, bi = s.min(dim=-1)  # each candidate block's best (first column on ties)
    best = torch.full((B,), float("inf"), device=z.device).scatter_reduce_(0, r, bs, "amin")
    col = torch.where(bs == best[r], b * _BLK + bi, Vl)
    idx = torch.full((B,), Vl, dtype=torch.long, device=z.device).scatter_reduce_(0, r, col, "amin")
    return best, idx.clamp_(max=Vl - 1)  # a row without a candidate (NaN logits) has best = inf


def _ordered_key(t: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 whose order, read as unsigned (bits ^ 2**31), is the float order."""
    b = t.contiguous().view(torch.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF) ^ -(2**31)


def _key_to_float(k: torch.Tensor) -> torch.Tensor:
    """int64 unsigned keys [B] in [0, 2**32) -> the float32 values they order."""
    b = (k - 2**31).to(torch.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).view(torch.float32)


def top_k_threshold(z: torch.Tensor, k: int, tp_group=None) -> torch.Tensor:
    """z [B, Vl] sharded on the vocabulary -> [B, 1]: the global k-th largest value."""
    local = z.topk(min(k, z.shape[-1]), dim=-1).values  # (B, k)
    # every rank's k best candidates: the global k-th value is among these tp*k numbers
    cands = all_gather_along(local, -1, tp_group)
    return cands.topk(min(k, cands.shape[-1]), dim=-1).values[:, -1:]


def top_p_threshold(zs: torch.Tensor, top_p: float, tp_group=None) -> torch.Tensor:
    """zs [B, Vl] (tempered logits, -inf where excluded) sharded on the vocabulary -> [B, 1] float32
    threshold tau: v is kept iff zs_v >= tau iff the mass of {u: zs_u > zs_v} is < top_p.

    Radix select on the order-preserving 32-bit key of zs, 8 bits per pass: each pass histograms
    the masses of the keys still in the candidate bucket into 256 bins, sums the histograms over
    the shards, and picks the bin where the mass above crosses top_p. Masses summed in float64."""
    B, Vl = zs.shape
    m = zs.amax(dim=-1, keepdim=True)
    all_reduce(m, "max", tp_group)  # global max per row, to normalise without overflow
    e = (zs - m).exp_()  # (B, Vl) unnormalised masses, float32 elementwise (layout-invariant)
    total = e.sum(-1, dtype=torch.float64)
    all_reduce(total, "sum", tp_group)  # the softmax normaliser over all shards
    target = top_p * total
    key = _ordered_key(zs)  # (B, Vl) int32, unsigned order
    rows = torch.arange(B, device=zs.device, dtype=torch.int32)[:, None] * 256
    bins = (((key >> 24) & 255) + rows).view(-1)  # first pass: bin of the top 8 bits, over all keys
    key, e, row = key.view(-1), e.view(-1).double(), None
    above = torch.zeros_like(total)  # mass of keys above the current bucket
    prefix = torch.zeros(B, dtype=torch.int64, device=zs.device)  # the bucket's high bits (unsigned)
    for level in (24, 16, 8, 0):
        if row is not None:
            bins = row * 256 + ((key >> level) & 255)
        hist = torch.zeros(B * 256, dtype=torch.float64, device=zs.device).index_add_(0, bins, e).view(B, 256)
        all_reduce(hist, "sum", tp_group)  # every shard's mass per bin of the current bucket
        gt = above[:, None] + hist.flip(-1).cumsum(-1).flip(-1) - hist  # mass above each bin
        j = (gt < target[:, None]).long().argmax(-1)  # lowest bin whose mass above is < top_p
        above = gt.gather(1, j[:, None])[:, 0]
        prefix = prefix * 256 + j
        if level:  # keep only the keys inside the chosen bin
            if row is None:
                at = (bins == (rows[:, 0] + j.to(torch.int32)).repeat_interleave(Vl)).nonzero()[:, 0]
                row = at // Vl
            else:
                at = (((key.to(torch.int64) & 0xFFFFFFFF) >> level) == prefix[row]).nonzero()[:, 0]
                row = row[at]
            key, e = key[at], e[at]
    return _key_to_float(prefix)[:, None]


def _winner_over_tp(best: torch.Tensor, gid: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's best (score [B], global id [B]) -> the winner over the TP ranks: the smallest
    score, the lowest id on ties; identical on every rank."""
    if group_size(tp_group) <= 1:
        return best, gid
    pair = torch.stack([best.double(), gid.double()], dim=-1)
    # each rank's best (score, global id), 2 numbers per row: the winner is picked locally after
    pairs = all_gather_along(pair.unsqueeze(1), 1, tp_group)  # (B, tp, 2)
    top = pairs[..., 0].min(dim=1, keepdim=True).values
    gid = pairs[..., 1].masked_fill(pairs[..., 0] != top, float("inf")).min(dim=1).values.long()
    return top[:, 0].float(), gid


def sharded_token_logprob(z: torch.Tensor, gid: torch.Tensor, temperature: float = 1.0, tp_group=None) -> torch.Tensor:
    """z [B, Vl] (float32 logits, -inf where excluded) sharded on the vocabulary, gid [B] global ids ->
    log softmax(z / temperature)[gid] [B] float32, identical on every rank. As the fused head: s = z / T
    - max, log p = s_y - log sum exp(s); one max and one [B, 2] sum all-reduce (the normaliser, and s_y
    from the one rank that holds y). One [B, Vl] temporary, worked in place; z is not changed."""
    B, Vl = z.shape
    start = group_rank(tp_group) * Vl
    s = z / temperature if temperature != 1.0 else z.clone()
    m = s.amax(dim=-1)
    all_reduce(m, "max", tp_group)  # the global max per row
    s.sub_(m[:, None])
    local = gid.to(z.device) - start
    held = (local >= 0) & (local < Vl)
    s_y = s.gather(1, local.clamp(0, Vl - 1)[:, None])[:, 0]
    sums = torch.stack([s.exp_().sum(-1), torch.where(held, s_y, torch.zeros_like(s_y))], dim=-1)
    all_reduce(sums, "sum", tp_group)  # normaliser over every shard; s_y from its owning rank
    return sums[:, 1] - sums[:, 0].log()


def _vocab_limited(logits_local: torch.Tensor, vocab_size: int, tp_group) -> torch.Tensor:
    """float32 logits with the columns of global id >= vocab_size at -inf (a copy only when needed)."""
    Vl = logits_local.shape[1]
    z = logits_local.float()
    n_valid = min(max(vocab_size - group_rank(tp_group) * Vl, 0), Vl)
    if n_valid < Vl:
        z = z.clone()
        z[:, n_valid:] = float("-inf")
    return z


def tempered_logprob(logits_local: torch.Tensor, gid: torch.Tensor, *, vocab_size: int, temperature: float,
                     tp_group=None) -> torch.Tensor:
    """log pi_T(gid) [B]: the untruncated log-softmax of logits_local / T over the ids < vocab_size,
    what the trainer's fused head computes for the same logits (temperature <= 0 reads as 1)."""
    z = _vocab_limited(logits_local, vocab_size, tp_group)
    return sharded_token_logprob(z, gid, temperature if temperature > 0 else 1.0, tp_group)


def sample_from_sharded_logits(logits_local: torch.Tensor, *, vocab_size: int, temperature: float, top_k: int = 0,
                               seed: int, step: int, row_ids: torch.Tensor, position: int, tp_group=None,
                               top_p: float = 1.0, min_p: float = 0.0, compile: bool = False,
                               return_logprobs: bool = False):
    """logits_local [B, Vp/tp] sharded on the vocabulary over tp_group -> sampled global ids [B],
    identical on every TP rank. temperature 0 means greedy. Columns with global id >= vocab_size
    (the model's padding, or past the tokenizer's vocabulary) are never drawn. `return_logprobs`:
    (ids, log mu(ids) [B] float32), mu the distribution drawn from: softmax(z / T) over the columns
    the filters kept, renormalised (0 for greedy: a point mass)."""
    B, Vl = logits_local.shape
    start = group_rank(tp_group) * Vl
    z = _vocab_limited(logits_local, vocab_size, tp_group)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    greedy = temperature <= 0
    inv_t = 1.0 if greedy else 1.0 / temperature
    thresholds = []  # (values to compare [B, Vl] -> callable, threshold [B, 1]); kept iff value >= thr
    if not greedy and top_k and top_k > 0:
        thresholds.append((None, top_k_threshold(z, top_k, tp_group)))
    if not greedy and top_p < 1.0:
        zs = z * inv_t
        if thresholds:
            zs = zs.masked_fill(z < thresholds[0][1], float("-inf"))
        thresholds.append(("tempered", top_p_threshold(zs, top_p, tp_group)))
    if not greedy and min_p > 0.0:
        m = z.amax(dim=-1, keepdim=True)
        all_reduce(m, "max", tp_group)  # p_v >= min_p p_max  <=>  (z_v - z_max) / T >= log(min_p)
        thresholds.append(("minp", m))
        log_min_p = math.log(min_p)
    if greedy:
        best, idx = z.max(dim=-1)
        best = -best  # smaller wins, as in the race
    else:
        if thresholds:  # filtered-out columns become -inf logits: their race score is +inf, never drawn
            drop = None
            for kind, thr in thresholds:
                if kind is None:
                    d = z < thr
                elif kind == "tempered":
                    d = z * inv_t < thr
                else:
                    d = (z - thr) * inv_t < log_min_p
                drop = d if drop is None else drop.logical_or_(d)
            z = z.masked_fill(drop, float("-inf"))
        rk = row_keys(seed, step, row_ids.to(z.device), position)
        ck = _col_keys_of(start, Vl, z.device)
        best, idx = race_argmin(z, rk, ck, inv_t, compile)
    best, gid = _winner_over_tp(best, idx + start, tp_group)
    if not greedy and bool(torch.isinf(best).any()):
        # every allowed column drew E = inf (w rounded to 1; ~2**-25 each): take the best logit
        fallback = sample_from_sharded_logits(logits_local, vocab_size=vocab_size, temperature=0.0, seed=seed,
                                              step=step, row_ids=row_ids, position=position, tp_group=tp_group)
        gid = torch.where(torch.isinf(best), fallback, gid)
    if not return_logprobs:
        return gid
    if greedy:
        return gid, torch.zeros(B, dtype=torch.float32, device=z.device)
    return gid, sharded_token_logprob(z, gid, temperature, tp_group)
