"""Blocked prefill (`rollout.prefill_tokens`, core/generation/generate.py): the prompts run through the model in
blocks of whole rows, each writing its own slice of the KV cache. Checked against the one-forward
prefill (float64: the same logits, cache and tokens), across DP ranks that hold different numbers of
distinct prompts (every rank runs the same number of forwards), and by what it allocates."""

import pytest
import torch

from core.config import ModelConfig
from core.generation.generate import _last_position_head, _prefill, generate
from core.model import KVCache, build_model

CFG = dict(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
           max_seq_len=64)


def _prompts(groups: list[int], P=6, seed=0):
    """Left-padded prompts [B, P]: one random prompt per entry of `groups`, repeated that many times."""
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for i, n in enumerate(groups):
        real = 2 + i % (P - 1)  # 2..P real tokens
        ids = torch.zeros(P, dtype=torch.long)
        ids[P - real:] = torch.randint(3, 131, (real,), generator=g)
        m = torch.zeros(P, dtype=torch.long)
        m[P - real:] = 1
        rows += [ids] * n
        masks += [m] * n
    return torch.stack(rows), torch.stack(masks)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("rows_per_block", [1, 2, 3])
def test_blocked_prefill_equals_one_forward(share, rows_per_block):
    cfg = ModelConfig(**CFG)
    model = build_model(cfg, seed=3).to(torch.float64).eval()
    ids, mask = _prompts([3, 1, 2, 1])  # 7 rows, 4 distinct prompts
    B, P = ids.shape
    outs = []
    for tokens in (0, rows_per_block * P + P - 1):  # one forward; blocks of rows_per_block rows
        cache = KVCache.empty(cfg, B, P + 4, 1, "cpu", torch.float64)
        with torch.no_grad():
            logits = _prefill(model, ids, mask, cache, _last_position_head(None), share, tokens)
        outs.append((logits, cache))
    (la, ca), (lb, cb) = outs
    assert cb.length == ca.length == P
    torch.testing.assert_close(lb, la, rtol=1e-12, atol=1e-12)
    for x, y in zip(ca.k + ca.v, cb.k + cb.v):
        torch.testing.assert_close(y[:, :, :P], x[:, :, :P], rtol=1e-12, atol=1e-12)
    kw = dict(max_new_tokens=5, eos_id=None, pad_id=0, temperature=1.0, seed=9, share_prefill=share)
    a = generate(model, ids, mask, prefill_tokens=0, **kw)
    b = generate(model, ids, mask, prefill_tokens=rows_per_block * P, **kw)
    assert torch.equal(a.sequences, b.sequences)


def _count_forwards(model) -> list[int]:
    n = [0]
    model.register_forward_pre_hook(lambda *_: n.__setitem__(0, n[0] + 1))
    return n


def _dp_blocked_prefill():
    """Rank 0: 6 distinct prompts; rank 1: one prompt 6 times. With share_prefill and one row per
    block, rank 0 needs 6 prefill forwards and rank 1 one: they must agree (FSDP keeps ranks in step)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    cfg = ModelConfig(**CFG)
    ids, mask = _prompts([1] * 6 if rank == 0 else [6], seed=rank)
    kw = dict(max_new_tokens=3, eos_id=None, pad_id=0, temperature=1.0, seed=2, share_prefill=True,
              row_ids=torch.arange(6) + 6 * rank)
    alone = generate(build_model(cfg, seed=3), ids, mask, prefill_tokens=0, **kw).sequences
    model = build_model(cfg, seed=3)
    mesh = init_device_mesh("cpu", (2,))
    for blk in model.layers:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = _count_forwards(model)
    out = generate(model, ids, mask, prefill_tokens=ids.shape[1], dp_group=dist.group.WORLD, **kw)
    return calls[0], torch.equal(out.sequences, alone)


@pytest.mark.slow
def test_dp_ranks_run_the_same_number_of_prefill_forwards(dist_pools):
    res = dist_pools.run(2, _dp_blocked_prefill, timeout=120)
    assert res[0][0] == res[1][0] == 6 + 2  # 6 prefill forwards (rank 1: 1 + 5 fillers), 2 decode steps
    assert res[0][1] and res[1][1]  # the same tokens as the one-forward prefill without FSDP


@pytest.mark.parametrize("tokens", [-1, 2.5, True])
def test_bad_prefill_tokens_refused(tokens):
    from rl.config import RolloutConfig

    with pytest.raises(ValueError, match="rollout.prefill_tokens must be an int >= 0"):
        RolloutConfig(prefill_tokens=tokens)


def test_compaction_copies_one_layer_at_a_time():
    """KVCache.keep_rows drops each layer's old tensor as its copy is made: the peak is the cache plus
    one layer's copy (allocator events, tools/klcost/cpu_peak.py), not two caches."""
    from tools.klcost.cpu_peak import profiled_peak

    cfg = ModelConfig(**dict(CFG, n_layers=4))
    B, L = 32, 64

    def run():
        cache = KVCache.empty(cfg, B, L, 1, "cpu", torch.float32)
        cache.keep_rows(torch.arange(24))  # 3/4 of the rows stay

    peak, _ = profiled_peak(run)
    layer = B * cfg.n_kv_heads * L * cfg.head_dim * 4  # bytes of one [B, nkv, L, hd] fp32 tensor
    want = 2 * cfg.n_layers * layer + layer * 24 // B  # the old code: + 6 layers' copies (786 KB more)
    assert abs(peak - want) <= 4096, (peak, want)  # a few small index tensors beside


def test_blocked_prefill_bounds_the_prefill_activations():
    """The whole generation's allocator peak with one-row prefill blocks sits below the one-forward
    prefill's by about the MLP transients of the rows it no longer runs at once."""
    from tools.klcost.cpu_peak import profiled_peak

    cfg = ModelConfig(vocab_size=512, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=512,
                      max_seq_len=128)
    model = build_model(cfg, seed=0).eval()
    B, P = 32, 48
    ids, mask = torch.randint(3, 512, (B, P)), torch.ones(B, P, dtype=torch.long)
    peaks = [profiled_peak(lambda t=t: generate(model, ids, mask, max_new_tokens=4, eos_id=None, pad_id=0,
                                                  prefill_tokens=t))[0] for t in (0, P)]
    mlp = 3 * P * cfg.intermediate_size * 4  # gate, up and their product, one row, fp32
    assert peaks[0] - peaks[1] >= (B - 1) * mlp, peaks
