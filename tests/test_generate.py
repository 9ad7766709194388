"""Sampling: KV cache against full recomputation, Gumbel-max against the softmax it should
follow, and the same tokens for every TP and DP layout."""

import torch

from core.config import ModelConfig
from core.generation.generate import generate, sample_from_sharded_logits
from core.model import KVCache, build_model

CFG = dict(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
           max_seq_len=64)


def _prompts(B=3, P=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 131, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_kv_cache_matches_full_forward():
    cfg = ModelConfig(**CFG)
    model = build_model(cfg, seed=3).eval()
    ids, mask = _prompts()
    nxt = torch.randint(3, 131, (3, 4))
    full_ids = torch.cat([ids, nxt], 1)
    full_mask = torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], 1)
    with torch.no_grad():
        ref = model(full_ids, attention_mask=full_mask)
        cache = KVCache.empty(cfg, 3, 10, 1, "cpu", torch.float32)
        out = [model(ids, attention_mask=mask, kv_cache=cache)]
        for t in range(4):
            out.append(model(nxt[:, t:t + 1], attention_mask=full_mask[:, :7 + t], kv_cache=cache))
    got = torch.cat(out, 1)
    valid = full_mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=1e-5)


def test_gumbel_sampling_follows_softmax_and_top_k():
    torch.manual_seed(0)
    V, Vp, n = 7, 8, 40000
    logits = torch.randn(1, Vp) * 1.5
    logits[0, V:] = 100.0  # a padded column with a huge logit must never be drawn
    rows = torch.arange(n)
    toks = sample_from_sharded_logits(logits.expand(n, Vp), vocab_size=V, temperature=0.7, top_k=0, seed=5,
                                      step=2, row_ids=rows, position=0)
    freq = torch.bincount(toks, minlength=Vp).double() / n
    p = torch.softmax(logits[0, :V].double() / 0.7, -1)
    assert freq[V:].sum() == 0
    assert (freq[:V] - p).abs().max() < 4 * (p * (1 - p) / n).sqrt().max() + 1e-3
    toks = sample_from_sharded_logits(logits.expand(n, Vp), vocab_size=V, temperature=1.0, top_k=3, seed=5,
                                      step=2, row_ids=rows, position=0)
    top3 = logits[0, :V].topk(3).indices
    freq = torch.bincount(toks, minlength=Vp).double() / n
    p3 = torch.softmax(logits[0, top3].double(), -1)
    assert set(toks.unique().tolist()) == set(top3.tolist())
    assert (freq[top3] - p3).abs().max() < 0.015
    greedy = sample_from_sharded_logits(logits, vocab_size=V, temperature=0.0, top_k=0, seed=0, step=0,
                                        row_ids=rows[:1], position=0)
    assert greedy.item() == logits[0, :V].argmax().item()


def _tp_sampling_and_generation(tp_sizes_ok):
    import torch.distributed as dist

    from parallel.comm import split_along
    g = dist.group.WORLD
    torch.manual_seed(1)
    V, Vp = 131, 192
    full = torch.randn(16, Vp)
    rows = torch.arange(16)
    kw = dict(vocab_size=V, temperature=1.0, seed=9, step=1, row_ids=rows, position=3)
    ref = sample_from_sharded_logits(full, top_k=0, **kw)
    got = sample_from_sharded_logits(split_along(full, -1, g), top_k=0, tp_group=g, **kw)
    ref_k = sample_from_sharded_logits(full, top_k=5, **kw)
    got_k = sample_from_sharded_logits(split_along(full, -1, g), top_k=5, tp_group=g, **kw)
    assert torch.equal(ref, got) and torch.equal(ref_k, got_k)

    cfg = ModelConfig(**CFG, eos_id=2)
    ids, mask = _prompts()
    single = build_model(cfg, seed=3)
    sharded = build_model(cfg, tp_group=g, seed=3)
    out1 = generate(single, ids, mask, max_new_tokens=8, eos_id=2, pad_id=0, temperature=1.0, top_k=20, seed=4)
    out2 = generate(sharded, ids, mask, max_new_tokens=8, eos_id=2, pad_id=0, temperature=1.0, top_k=20, seed=4,
                    tp_group=g)
    assert torch.equal(out1.sequences, out2.sequences)
    assert torch.equal(out1.response_mask, out2.response_mask)
    return out2.sequences.tolist()


def test_sampling_same_tokens_under_tp(dist_pools):
    res = dist_pools.run(2, _tp_sampling_and_generation, True)
    assert res[0] == res[1]


def _dp_ranks_stay_in_step():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    cfg = ModelConfig(**CFG)
    model = build_model(cfg, seed=3)
    ids, mask = _prompts(seed=rank)
    with torch.no_grad():
        first = model(ids, attention_mask=mask)[:, -1, :131].argmax(-1)
    for blk in model.layers:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # rank 0's rows all stop at once (their greedy first token is "EOS"); rank 1's run on
    eos = int(first[0]) if rank == 0 else -1
    if rank == 0:
        ids, mask = ids[:1].expand(3, -1).clone(), mask[:1].expand(3, -1).clone()
    out = generate(model, ids, mask, max_new_tokens=6, eos_id=eos, pad_id=0, temperature=0.0, dp_group=dist.group.WORLD)
    return out.response_mask.sum(1).tolist()


def test_dp_ranks_kept_in_step_under_fsdp(dist_pools):
    lens = dist_pools.run(2, _dp_ranks_stay_in_step, timeout=120)
    assert lens[0] == [1, 1, 1]  # EOS counted as part of the response
    assert lens[1] == [6, 6, 6]


def test_prefill_projects_only_the_last_position():
    """Prefill's LM head costs B x H x Vp multiply-adds, not B x P x H x Vp: flops of a one-token
    generation = the body over the prompt + the head on one position per row."""
    from torch.utils.flop_counter import FlopCounterMode
    cfg = ModelConfig(**CFG)
    model = build_model(cfg, seed=3).eval()
    ids, mask = _prompts()
    with torch.no_grad(), FlopCounterMode(display=False) as body:
        model(ids, attention_mask=mask, head=lambda x, w: x)
    with FlopCounterMode(display=False) as gen:
        generate(model, ids, mask, max_new_tokens=1, eos_id=None, pad_id=0, temperature=0.0)
    B, H, Vp = ids.shape[0], cfg.hidden_size, model.padded_vocab
    assert gen.get_total_flops() == body.get_total_flops() + 2 * B * H * Vp


def test_left_padded_batch_matches_unpadded_single_rows():
    """Each left-padded row generates exactly what it generates alone without padding (positions,
    masks and cache right), sampled with the row's id."""
    cfg = ModelConfig(**CFG)
    model = build_model(cfg, seed=3)
    ids, mask = _prompts()
    rows = torch.tensor([5, 17, 2])
    kw = dict(max_new_tokens=7, eos_id=None, pad_id=0, temperature=1.0, top_p=0.9, seed=4, step=2)
    batch = generate(model, ids, mask, row_ids=rows, **kw)
    for i in range(3):
        real = ids[i:i + 1, mask[i].bool()]
        one = generate(model, real, torch.ones_like(real), row_ids=rows[i:i + 1], **kw)
        assert torch.equal(one.sequences[0, real.shape[1]:], batch.sequences[i, ids.shape[1]:])


def _truncate_at_stop(resp: list[int], stop) -> int:
    """Length of the response up to and including the first token at which `stop(prefix)` holds."""
    for t in range(len(resp)):
        if stop(resp[:t + 1]):
            return t + 1
    return len(resp)


def test_stops_on_eos_ids_sequences_and_check_with_compaction():
    """Stopping keeps each row's tokens up to and including the stop and masks the rest; checked
    against the unstopped generation truncated by a hand-written loop, with and without compaction."""
    cfg = ModelConfig(**CFG)
    model = build_model(cfg, seed=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 131, (12, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(max_new_tokens=16, pad_id=0, temperature=1.0, seed=7)
    free = generate(model, ids, mask, eos_id=None, **kw)
    resp = free.sequences[:, 5:].tolist()
    eos_ids = sorted({r[3] for r in resp[:4]} | {r[9] for r in resp[4:6]})  # several rows stop early
    seq = resp[7][5:7]  # a stop token sequence
    check = lambda r: sum(r) % 29 == 0  # noqa: E731  (a stand-in for a decoded-text check)

    def stop(prefix):
        return prefix[-1] in eos_ids or prefix[-2:] == seq or check(prefix)

    for compact in (True, False):
        out = generate(model, ids, mask, eos_id=eos_ids[0], eos_ids=eos_ids, stop_sequences=[seq],
                       stop_check=check, compact=compact, **kw)
        for i, r in enumerate(resp):
            n = _truncate_at_stop(r, stop)
            assert out.sequences[i, 5:5 + n].tolist() == r[:n]
            assert out.response_mask[i].tolist() == [1] * n + [0] * (16 - n)
            assert (out.sequences[i, 5 + n:] == 0).all()
        assert out.n_tokens == sum(_truncate_at_stop(r, stop) for r in resp)
    assert min(_truncate_at_stop(r, stop) for r in resp) < 8  # the stops did cut rows short


def test_generation_never_samples_past_vocab_limit():
    cfg = ModelConfig(**CFG)
    model = build_model(cfg, seed=3)
    with torch.no_grad():
        model.lm_head.weight[100:] *= 50  # make the columns past the "tokenizer" the likeliest
    ids, mask = _prompts()
    out = generate(model, ids, mask, max_new_tokens=10, eos_id=None, pad_id=0, temperature=1.0, seed=1,
                   vocab_limit=100)
    assert out.sequences[:, ids.shape[1]:].max() < 100
    free = generate(model, ids, mask, max_new_tokens=10, eos_id=None, pad_id=0, temperature=1.0, seed=1)
    assert free.sequences[:, ids.shape[1]:].max() >= 100  # without the limit they would be drawn


def test_min_new_tokens_suppresses_eos_until_then():
    """With the stop id the last vocabulary column, suppressing it equals never sampling past
    vocab_limit = V - 1 (tested above): the same tokens up to min_new_tokens, no stop before it;
    after it the (more likely) stop id ends rows again."""
    cfg = ModelConfig(**CFG)
    model = build_model(cfg, seed=3)
    eos = cfg.vocab_size - 1
    with torch.no_grad():
        model.lm_head.weight[eos] *= 20  # the stop id is drawn often
    ids, mask = _prompts()
    P, kw = ids.shape[1], dict(max_new_tokens=10, pad_id=0, temperature=1.0, seed=1)
    free = generate(model, ids, mask, eos_id=None, vocab_limit=eos, **kw)
    assert generate(model, ids, mask, eos_id=eos, **kw).n_tokens < 10 * ids.shape[0]  # unsuppressed: stops early
    full = generate(model, ids, mask, eos_id=eos, min_new_tokens=10, **kw)
    assert torch.equal(full.sequences, free.sequences) and full.n_tokens == 10 * ids.shape[0]
    part = generate(model, ids, mask, eos_id=eos, min_new_tokens=4, **kw)
    assert torch.equal(part.sequences[:, P:P + 4], free.sequences[:, P:P + 4])
    assert (part.sequences[:, P:P + 4] != eos).all()
    lens = part.response_mask.sum(1).tolist()
    assert min(lens) >= 4 and all(n == 10 or part.sequences[i, P + n - 1] == eos for i, n in enumerate(lens))
    assert min(lens) < 10  # a stop after min_new_tokens still ends a row
