"""The sampler against float64 references: frequencies (chi-square) for plain, top-k, top-p and
min-p sampling, the top-p threshold against exact enumeration, padded / out-of-tokenizer columns
never drawn, and identical tokens for every TP layout (tp 1, 2, 4)."""

import pytest
import torch

from core.generation.sampling import sample_from_sharded_logits, top_p_threshold

V, VP, N = 10, 12, 20000  # true vocabulary, padded, samples (one row id each)


def _logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, VP, generator=g, dtype=torch.float64).float() * 1.2
    z[0, V:] = 50.0  # padded columns with huge logits: never drawn
    return z


def _kept_probs(z: torch.Tensor, T: float, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """float64 reference over the true vocabulary, by hand: temperature, top-k, top-p, min-p."""
    zs = z[0, :V].double() / T
    keep = torch.ones(V, dtype=torch.bool)
    if top_k:
        keep &= zs >= zs.topk(top_k).values[-1]
    if top_p < 1.0:
        p = torch.softmax(zs.masked_fill(~keep, float("-inf")), -1)
        above = torch.tensor([p[zs > zs[v]].sum() for v in range(V)], dtype=torch.float64)
        keep &= above < top_p
    if min_p > 0.0:
        p = torch.softmax(zs, -1)
        keep &= p >= min_p * p.max()
    return torch.softmax(zs.masked_fill(~keep, float("-inf")), -1)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square test of counts against probs (bins with p > 0); p-value via the
    regularised upper incomplete gamma."""
    nz = probs > 0
    exp = probs[nz] * counts.sum()
    stat = ((counts[nz].double() - exp) ** 2 / exp).sum()
    df = int(nz.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("T,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 4, 1.0, 0.0),
                                                 (1.0, 0, 0.8, 0.0), (0.8, 6, 0.7, 0.0), (1.0, 0, 1.0, 0.15)])
def test_frequencies_follow_the_filtered_softmax(T, top_k, top_p, min_p):
    z = _logits()
    toks = sample_from_sharded_logits(z.expand(N, VP), vocab_size=V, temperature=T, top_k=top_k, top_p=top_p,
                                      min_p=min_p, seed=11, step=3, row_ids=torch.arange(N), position=5)
    counts = torch.bincount(toks, minlength=VP)
    probs = _kept_probs(z, T, top_k, top_p, min_p)
    assert counts[V:].sum() == 0
    assert counts[:V][probs == 0].sum() == 0, "a filtered-out token was drawn"
    assert _chi2_pvalue(counts[:V], probs) > 1e-4


def test_noise_independent_over_positions_and_rows():
    """The same row at different positions, and different rows, draw independently: pairs of
    consecutive positions follow the product distribution (chi-square on the joint counts)."""
    z = _logits(1)
    rows = torch.arange(N)
    kw = dict(vocab_size=V, temperature=1.0, seed=2, step=0, row_ids=rows)
    a = sample_from_sharded_logits(z.expand(N, VP), position=0, **kw)
    b = sample_from_sharded_logits(z.expand(N, VP), position=1, **kw)
    p = _kept_probs(z, 1.0)
    top = p.topk(3).indices  # the three likeliest tokens, the rest pooled: enough counts per cell
    cat = lambda t: torch.where(t[:, None] == top[None], torch.arange(3), 3).min(-1).values  # noqa: E731
    pc = torch.cat([p[top], (1 - p[top].sum()).reshape(1)])
    joint = torch.bincount(cat(a) * 4 + cat(b), minlength=16)
    assert _chi2_pvalue(joint, (pc[:, None] * pc[None, :]).reshape(-1)) > 1e-4


def test_top_p_threshold_matches_enumeration():
    g = torch.Generator().manual_seed(0)
    zs = torch.randn(6, 40, generator=g) * 2
    zs[0, :10] = 1.0  # ties
    zs[1, 5:] = float("-inf")  # excluded columns
    zs[2] = 0.0  # all equal
    zs[3, :] = torch.linspace(-3, 3, 40)
    for p in (1e-6, 0.1, 0.5, 0.9, 0.999):
        tau = top_p_threshold(zs, p)
        pr = torch.softmax(zs.double(), -1)
        for r in range(6):
            keep = torch.tensor([pr[r][zs[r] > zs[r, v]].sum() < p for v in range(40)])
            assert torch.equal(zs[r] >= tau[r], keep), (p, r)


def test_vocab_limit_and_greedy():
    z = _logits(2)
    z[0, 7] = 30.0  # the likeliest column lies past the tokenizer's vocabulary (limit 7)
    toks = sample_from_sharded_logits(z.expand(N, VP), vocab_size=7, temperature=1.0, seed=0, step=0,
                                      row_ids=torch.arange(N), position=0)
    assert toks.max() < 7
    g = sample_from_sharded_logits(z, vocab_size=7, temperature=0.0, seed=0, step=0, row_ids=torch.arange(1),
                                   position=0)
    assert g.item() == z[0, :7].argmax().item()


def test_bad_filters_are_named():
    z = _logits()
    with pytest.raises(ValueError, match="top_p"):
        sample_from_sharded_logits(z, vocab_size=V, temperature=1.0, top_p=0.0, seed=0, step=0,
                                   row_ids=torch.arange(1), position=0)
    with pytest.raises(ValueError, match="min_p"):
        sample_from_sharded_logits(z, vocab_size=V, temperature=1.0, min_p=1.5, seed=0, step=0,
                                   row_ids=torch.arange(1), position=0)


CASES = [dict(), dict(top_k=5), dict(top_p=0.7), dict(min_p=0.1), dict(top_k=40, top_p=0.9, min_p=0.02),
         dict(temperature=0.0)]


def _same_tokens_under_tp():
    import torch.distributed as dist

    from parallel.comm import split_along
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(4)
    Vtrue, Vp, B = 131, 136, 64
    full = torch.randn(B, Vp, generator=gen) * 2
    full[:8, 10:20] = 3.0  # tied logits across the shard boundaries
    full[:, Vtrue:] = 40.0  # padding: never drawn
    out = []
    for case in CASES:
        kw = dict(vocab_size=100 if "min_p" in case else Vtrue, seed=9, step=1, row_ids=torch.arange(B) * 7,
                  position=3, temperature=case.get("temperature", 0.9))
        kw.update({k: v for k, v in case.items() if k != "temperature"})
        ref = sample_from_sharded_logits(full, **kw)
        got = sample_from_sharded_logits(split_along(full, -1, g), tp_group=g, **kw)
        assert torch.equal(ref, got), case
        out.append(got.tolist())
    return out


def test_same_tokens_tp2(dist_pools):
    res = dist_pools.run(2, _same_tokens_under_tp)
    assert res[0] == res[1]


@pytest.mark.slow
def test_same_tokens_tp4(dist_pools):
    res = dist_pools.run(4, _same_tokens_under_tp)
    assert all(r == res[0] for r in res)


@pytest.mark.slow
def test_compiled_sampler_draws_the_same_tokens():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(64, 300, generator=g) * 2
    kw = dict(vocab_size=290, temperature=0.8, seed=5, step=1, row_ids=torch.arange(64), position=2)
    for extra in (dict(), dict(top_k=20, min_p=0.01)):
        eager = sample_from_sharded_logits(z, **kw, **extra)
        assert torch.equal(sample_from_sharded_logits(z, compile=True, **kw, **extra), eager)
    # wide shards take the pruned path under compile (and a second batch size: the dynamic recompile)
    z = _wide_logits()
    for rows, extra in ((48, dict()), (40, dict(top_k=50, top_p=0.9, min_p=0.001))):
        kw = dict(vocab_size=4050, temperature=0.8, seed=5, step=1, row_ids=torch.arange(rows), position=2, **extra)
        eager = sample_from_sharded_logits(z[:rows], **kw)
        assert torch.equal(sample_from_sharded_logits(z[:rows], compile=True, **kw), eager)


@pytest.mark.slow
def test_compiled_wide_sampler_frequencies():
    """compile=True on a 4096-column shard (the pruned race) draws from the softmax (chi-square)."""
    z = torch.full((1, 4096), -3.0)
    z[0, :V] = _logits()[0, :V] + 3.0  # ten likely tokens, 4086 unlikely ones pooled into one bin
    toks = sample_from_sharded_logits(z.expand(N, 4096), vocab_size=4096, temperature=1.0, seed=11, step=3,
                                      row_ids=torch.arange(N), position=5, compile=True)
    p = torch.softmax(z[0].double(), -1)
    counts = torch.bincount(toks.clamp(max=V), minlength=V + 1)
    probs = torch.cat([p[:V], p[V:].sum().reshape(1)])
    assert _chi2_pvalue(counts, probs) > 1e-4


def _wide_logits(B=48, Vl=4100, seed=7):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, Vl, generator=g) * torch.tensor([0.0, 0.5, 3.0, 40.0]).repeat(B // 4)[:, None]
    z[:, -70:] = float("-inf")  # past the vocabulary
    z[5] = float("-inf")
    z[5, 4000] = 2.0  # one allowed column
    z[6, 100:300] = 7.0  # a plateau of equal logits
    return z


def _scores64(z, rk, ck, inv_t):
    """float64 race scores log E - z / T from the hash's integers, written out independently."""
    from core.generation.sampling import _hash
    w = _hash(rk[:, None], ck[None, :]).to(torch.float32).double() * 2.0**-31
    return torch.log(-torch.log1p(-w)) - z.double() * inv_t


@pytest.mark.parametrize("inv_t", [1.0, 1 / 0.3, 1 / 3.0])
def test_pruned_race_matches_the_exact_race(inv_t):
    """The block-pruned race (compile=True's algorithm, here with eager bounds) picks the same column and
    score as the race over every column, and that column minimises the float64 scores; each block's
    bounds hold around the float64 scores of its columns."""
    from core.generation.sampling import _BLK, _block_bounds, _race_exact, _race_pruned, col_keys, row_keys
    z = _wide_logits()
    rk, ck = row_keys(9, 2, torch.arange(100, 148), 4), col_keys(torch.arange(3000, 3000 + z.shape[1]))
    best, idx = _race_pruned(z, rk, ck, inv_t, _block_bounds)
    ref_best, ref_idx = _race_exact(z, rk, ck, inv_t)
    assert torch.equal(idx, ref_idx) and torch.equal(best, ref_best)
    s64 = _scores64(z, rk, ck, inv_t)
    tol = 1e-5 * (1 + z.abs().nan_to_num(posinf=0, neginf=0).max() * inv_t)
    assert (s64.gather(1, idx[:, None])[:, 0] <= s64.min(-1).values + tol).all()
    nb = z.shape[1] // _BLK
    lo, hi = _block_bounds(z[:, :nb * _BLK].view(48, nb, _BLK), rk.view(-1, 1, 1),
                           ck[:nb * _BLK].view(1, nb, _BLK), inv_t)
    smin = s64[:, :nb * _BLK].view(48, nb, _BLK).min(-1).values
    assert (lo.double() <= smin).all() and (smin <= hi.double()).all()


def test_row_keys_match_a_per_row_reference():
    """row_keys (seed and step mixed as Python ints, rows and position on tensors) against the chain of
    32-bit finalisers written out per row, including a negative seed and ids past 2**31."""
    from core.generation.sampling import row_keys

    def mix(x):
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    rows = [0, 5, 2**31 + 7, 12345678901]
    for seed, step, pos in [(0, 0, 0), (1, 3, 5), (-7, 2**33, 9)]:
        want = [mix(mix(mix(mix(seed ^ 0x9E3779B9) ^ step) ^ r) ^ pos) for r in rows]
        want = [w - 2**32 if w >= 2**31 else w for w in want]
        assert row_keys(seed, step, torch.tensor(rows), pos).tolist() == want
