"""Micro-batches by token budget and packed sequences (rl/update/micro_batches.py, core/model.py's
document_ids, rl/update/logprobs.py's packed heads).

References: the planner against hand-counted lengths and budgets; the packed forward against each
row run alone, unpadded; the token-budget and packed updates against today's padded update (rows
in mini-batch order, untrimmed), in float64, at dp=1 and at dp=2 with skewed lengths per rank
(rank 0 short and empty responses, rank 1 long ones), so the ranks' local micro-batch counts
differ and must be agreed for FSDP's collectives.
"""

from __future__ import annotations

import pytest
import torch

from core.config import ModelConfig, load_config
from core.model import build_model
from rl.config import AlgoConfig
from rl.experience.rollout import Rollout
from rl.update.micro_batches import by_token_budget, group_packed, group_padded, pack_rows, row_lengths, split_to
from rl.update.shared_layout import shared_by_token_budget
from tests.helpers import model_config

# ---------------------------------------------------------------------------------------------
# planning, by hand


def _rollout(prompts: list[int], responses: list[int], P: int = 5, N: int = 6, seed: int = 0) -> Rollout:
    """Rows with prompts[i] real prompt tokens (left-padded to P) and responses[i] response tokens."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompts)
    seq = torch.randint(3, 100, (B, P + N), generator=g, device="cpu")
    am = torch.zeros(B, P + N, dtype=torch.long, device="cpu")
    rm = torch.zeros(B, N, dtype=torch.bool, device="cpu")
    for i, (p, n) in enumerate(zip(prompts, responses)):
        am[i, P - p:P + n] = 1
        rm[i, :n] = True
    seq = torch.where(am.bool(), seq, torch.zeros_like(seq))
    return Rollout(seq, am, rm, P, torch.zeros(B, device="cpu"), torch.arange(B, device="cpu"), [], [])


def test_row_lengths_and_budget_groups():
    ro = _rollout([3, 5, 2, 4, 1], [6, 0, 2, 1, 5])
    p, n = row_lengths(ro, torch.arange(5, device="cpu"))
    assert (p, n) == ([3, 5, 2, 4, 1], [6, 0, 2, 1, 5])
    pd, nd = dict(enumerate(p)), dict(enumerate(n))
    order = [0, 4, 3, 2]  # by length, the empty row 1 left out
    # padded runs, each rows x (max p + max n) <= budget, cost = padded tokens + budget / 8 per run.
    # budget 12: [0][4][3,2] = 9 + 6 + 2 x 6 + 3 x 1.5 = 31.5 > [0][4][3][2] = 24 + 4 x 1.5 = 30
    assert group_padded(order, pd, nd, 12) == [[0], [4], [3], [2]]
    # budget 100: one run 4 x 10 + 12.5 = 52.5 < [0,4][3,2] 18 + 12 + 25 = 55 < [0][4,3,2] 9 + 27 + 25
    assert group_padded(order, pd, nd, 100) == [[0, 4, 3, 2]]
    # a long row does not pad short ones: [L][6 short] 12 + 18 + 25 = 55 < one run 7 x 12 + 12.5 = 96.5
    long_short = {0: 2, **{i: 2 for i in range(1, 7)}}, {0: 10, **{i: 1 for i in range(1, 7)}}
    assert group_padded(list(range(7)), *long_short, 100) == [[0], [1, 2, 3, 4, 5, 6]]
    assert group_padded(order, pd, nd, 1) == [[0], [4], [3], [2]]  # a row over budget runs alone
    # packed, first-fit decreasing on lengths 9, 6, 5, 4 into bins of 11: [9], [6, 5], then 4 opens a third
    assert group_packed(order, pd, nd, 11) == [[0], [4, 3], [2]]
    assert group_packed(order, pd, nd, 15) == [[0, 4], [3, 2]]  # 9 + 6; 5 + 4


def test_split_to_matches_count_then_fills():
    cost = len
    assert split_to([[1, 2, 3, 4], [5]], 3, cost) == [[1, 2], [3, 4], [5]]
    assert split_to([[1], [2]], 4, cost) == [[1], [2], None, None]
    assert split_to([], 2, cost) == [None, None]


def test_budget_micro_batches_cover_rows_once_and_trim():
    ro = _rollout([3, 5, 2, 4, 1, 5], [6, 0, 2, 1, 5, 3])
    rows = torch.tensor([5, 0, 1, 2, 3, 4], device="cpu")
    for packed in (False, True):
        mbs = by_token_budget(ro, rows, 12, packed)
        got = sorted(i for m in mbs for i in m.rows.tolist())
        assert got == [0, 2, 3, 4, 5]  # every row with a response, once
        for m in mbs:
            p = [[3, 5, 2, 4, 1, 5][i] for i in m.rows.tolist()]
            n = [[6, 0, 2, 1, 5, 3][i] for i in m.rows.tolist()]
            assert (m.prompt_cols, m.response_cols) == (max(p), max(n))
            sub = m.rollout(ro)
            assert sub.sequences.shape == (len(p), max(p) + max(n))
            assert torch.equal(sub.attention_mask.sum(1), torch.tensor(p, device="cpu") + torch.tensor(n, device="cpu"))
            if packed:
                assert m.packed.input_ids.shape[1] == sum(p) + sum(n)


def test_pack_rows_by_hand():
    ro = _rollout([2, 3], [2, 1], P=3, N=2)
    pk = pack_rows(ro, [1, 0], [3, 2], [1, 2])
    s = ro.sequences
    assert pk.input_ids.tolist() == [[s[1, 0], s[1, 1], s[1, 2], s[1, 3], s[0, 1], s[0, 2], s[0, 3], s[0, 4]]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert pk.document_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    assert pk.src_rows.tolist() == [1, 0, 0] and pk.src_cols.tolist() == [0, 0, 1]
    assert pk.head_pos.tolist() == [2, 5, 6]  # the position before each response token
    assert pk.targets.tolist() == [s[1, 3], s[0, 3], s[0, 4]]


def test_config_errors_name_the_keys():
    with pytest.raises(ValueError, match="micro_batch_size=4.*micro_batch_tokens=64"):
        AlgoConfig(micro_batch_size=4, micro_batch_tokens=64)
    with pytest.raises(ValueError, match="pack_sequences.*micro_batch_tokens"):
        AlgoConfig(pack_sequences=True)


# ---------------------------------------------------------------------------------------------
# the packed forward


@pytest.mark.parametrize("variant", ["v131_untied", "v128_tied_bias_ac"])
def test_packed_forward_equals_each_row_alone(variant):
    torch.set_num_threads(1)
    cfg = model_config(variant)
    cfg = ModelConfig(**{**cfg.__dict__, "max_seq_len": 32})
    model = build_model(cfg, seed=3)
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, cfg.vocab_size, (n,), generator=g, device="cpu") for n in (7, 1, 12, 4)]
    ids = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((len(d),), i, device="cpu") for i, d in enumerate(docs)])[None]
    packed = model(ids, document_ids=doc_ids)[0]  # (T, Vp), positions restart per document
    got = torch.split(packed, [len(d) for d in docs])
    for d, x in zip(docs, got):
        torch.testing.assert_close(x, model(d[None])[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="document_ids"):
        model(ids, document_ids=doc_ids, attention_mask=torch.ones_like(ids))


# ---------------------------------------------------------------------------------------------
# the update: token budget and packing against padding, float64

MODEL = dict(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
             max_seq_len=64)
BASE = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=1",
        "reward.use_task_reward=false", "reward.fns=[tests.reward_plugins:digits_over_6]", "optim.lr=1e-2",
        "optim.warmup_steps=0", "optim.grad_clip=0.5", "kl_ctl.beta=0.1", "train.progress=false",
        "algo.epochs=2", "algo.mini_batches=2"]
GRPO = ["algo.name=grpo", "kl.estimator=k3+", "loss.entropy_coef=0.01"]
EXACT = ["algo.name=grpo", "kl.exact=true", "loss.agg=seq-mean-token-mean"]
PPO = ["algo.name=ppo", "kl.where=reward", "kl.estimator=k1"]
PADDED = ["algo.share_prompts=false"]  # rows in mini-batch order, untrimmed: the reference
BUDGET, PACKED = ["algo.micro_batch_tokens=40", "algo.share_prompts=false"], ["algo.micro_batch_tokens=40",
                                                                               "algo.pack_sequences=true"]
SHARED = ["algo.micro_batch_tokens=40", "algo.share_prompts=true"]  # each prompt once, R x W <= 40
STATS = ("pg_loss", "kl_loss", "clipfrac", "ratio_mean", "approx_kl_old", "grad_norm")


def _skew(data) -> None:
    """Prompts 0 and 1 (rank 0 at dp=2): responses cut to 1 token, rows 0 and 5 to none; the rest keep
    their 6. In place (mask, attention mask)."""
    ro, P = data.ro, data.ro.prompt_len
    short = ro.row_ids < 8
    data.mask[short, 1:] = False
    ro.attention_mask[short, P + 1:] = 0
    empty = (ro.row_ids == 0) | (ro.row_ids == 5)
    data.mask[empty] = False
    ro.attention_mask[empty, P:] = 0


def _update(dp: int, overrides: list[str]):
    """One update (2 epochs x 2 mini-batches) in float64 on skewed rollouts: each optimizer step's
    full policy (and critic) gradients, the update's statistics, this rank's micro-batch plan."""
    from core.tokenizer import load_tokenizer
    from parallel.dims import ParallelDims, init_parallel, kv_replica_group
    from parallel.fsdp import full_tensor
    from rl.config import RLConfig
    from rl.models.critic import Critic
    from rl.train import assemble

    torch.set_num_threads(1)
    cfg = load_config(RLConfig, None, BASE + overrides)
    mc = ModelConfig(**MODEL)
    state = init_parallel(ParallelDims(dp, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    kv = kv_replica_group(state, mc.n_kv_heads)
    policy, ref = (build_model(mc, state.tp_group, kv, seed=11, dtype=torch.float64) for _ in range(2))
    critic = None
    if cfg.algo.name == "ppo":
        critic = Critic(mc, state.tp_group, kv, dtype=torch.float64)
        critic.body.init_weights(11)
    tr = assemble(cfg, state, mc, load_tokenizer(None), policy, ref, critic)
    data = tr.make_experience(0)
    _skew(data)
    grads, plans = [], []
    for model, opt in ((tr.policy, tr.opt), (tr.critic, tr.critic_opt)):
        if model is None:
            continue
        real = opt.step

        def step(model=model, real=real):
            grads.append({n: full_tensor(p.grad).clone() for n, p in model.named_parameters()})
            return real()

        opt.step = step
    plan = tr.updater._micro_batches

    def recording(data, rows):
        out = plan(data, rows)
        a = cfg.algo
        local = len(out)  # this rank's own count: the plan without dp_group
        if a.micro_batch_tokens and a.share_prompts:
            local = len(shared_by_token_budget(data.ro, rows, a.micro_batch_tokens))
        elif a.micro_batch_tokens:
            local = len(by_token_budget(data.ro, rows, a.micro_batch_tokens, a.pack_sequences))
        shared = [m.packed.input_ids.numel() for m in out if m.packed is not None and m.packed.prefix_ids is not None]
        plans.append((local, len(out), sum(m.filler for m in out), max(shared, default=0)))
        return out

    tr.updater._micro_batches = recording
    rec = tr.update(data, 0)
    return grads, {k: rec[k] for k in STATS if k in rec}, plans


def _same(ref, got, tol=1e-12):
    g0, s0, _ = ref
    g1, s1, _ = got
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1):
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=tol, rtol=tol, msg=lambda m, k=k: f"{k}: {m}")
    for k in s0:  # core.optim reports the gradient norm as a float32
        assert s1[k] == pytest.approx(s0[k], rel=1e-6 if k == "grad_norm" else 1e-9, abs=1e-12), k


@pytest.mark.parametrize("algo", [GRPO, EXACT, PPO, GRPO + ["algo.fused_loss=false"]], ids=["grpo", "exact", "ppo",
                                                                                            "unfused"])
@pytest.mark.slow
def test_budget_and_packed_updates_equal_padded(algo):
    """dp=1, float64: the same gradient at every optimizer step (policy and critic) and the same
    statistics as the padded update, with rows grouped by a 40-token budget, trimmed, packed or in the
    shared-prompt layout."""
    padded = _update(1, algo + PADDED)
    for mode in (BUDGET, PACKED, SHARED):
        got = _update(1, algo + mode)
        _same(padded, got)
        assert any(n > 1 for _, n, *_ in got[2])  # the budget did split mini-batches


@pytest.mark.slow
def test_dp2_skewed_lengths_agree_and_equal_dp1(dist_pools):
    """dp=2, rank 0 holding only short and empty responses, rank 1 long ones: the local counts differ,
    every rank runs the agreed count (rank 0 splits; at 20 tokens it runs out of rows and adds
    zero-weight fillers), nothing hangs, and the gradients and statistics equal the single-process
    padded update's. (Without the agreement this configuration hangs in FSDP's collectives.)"""
    padded = _update(1, GRPO + PADDED)
    for tokens in (40, 20):
        for pack in ("false", "true"):
            res = dist_pools.run(2, _update, 2, GRPO + [f"algo.micro_batch_tokens={tokens}",
                                                        f"algo.pack_sequences={pack}", "algo.share_prompts=false"])
            (_, _, plan0), (_, _, plan1) = res
            assert [n for _, n, *_ in plan0] == [n for _, n, *_ in plan1]  # agreed counts ...
            assert all(a[0] < b[0] for a, b in zip(plan0, plan1))  # ... where rank 0 alone had fewer
            assert (sum(p[2] for p in plan0) > 0) == (tokens == 20)  # fillers only when rows ran out
            for r in res:
                _same(padded, r, tol=1e-11)


@pytest.mark.slow
def test_dp2_shared_budget_agrees_and_equals_dp1(dist_pools):
    """The shared-prompt layout under a token budget at dp=2 with the skewed ranks above (prompts of 7
    tokens: rank 0's groups 7 + 1 + 1, rank 1's 7 + 6 + 6 per mini-batch). At 30 tokens rank 1 needs
    two micro-batches [1, 19], rank 0 one [2, 9] and halves it; at 13 rank 1 splits each group into
    pieces [1, 13], four, and rank 0 (a group holding an empty row has one response left) halves down
    to single responses and adds fillers. Both ranks run the agreed count, every micro-batch's R x W
    stays within the budget, and the update equals the single-process padded one in float64."""
    padded = _update(1, GRPO + PADDED)
    for tokens in (30, 13):
        res = dist_pools.run(2, _update, 2, GRPO + [f"algo.micro_batch_tokens={tokens}", "algo.share_prompts=true"])
        (_, _, plan0), (_, _, plan1) = res
        assert [n for _, n, *_ in plan0] == [n for _, n, *_ in plan1]  # agreed counts ...
        assert all(a[0] < b[0] for a, b in zip(plan0, plan1))  # ... where rank 0 alone had fewer
        assert (sum(p[2] for p in plan0) > 0) == (tokens == 13)  # fillers only when rows ran out
        assert all(0 < p[3] <= tokens for p in plan0 + plan1)  # shared layouts [R, W], R x W <= budget
        for r in res:
            _same(padded, r, tol=1e-11)
