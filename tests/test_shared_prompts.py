"""Shared-prompt forward for GRPO groups (rl/update/shared_layout.py, core/model.py's prefix_ids,
core/generation/generate.py's share_prefill).

References: the layout against a hand-written example; per-token log-probs, entropy, exact KL,
losses and every parameter gradient against the padded row-by-row forward in float64 (prompts of
different lengths, a single-row group, an empty response, rows of a group not adjacent); one
response against its row run alone, unpadded, while the other responses of its group change; tp=2
against tp=1; a trainer update with share_prompts on against off; shared prefill against the
unshared rollout's tokens.
"""

from __future__ import annotations

import pytest
import torch

from core.config import ModelConfig, load_config
from core.generation.generate import generate
from core.model import build_model, document_mask_4d
from rl.config import AlgoConfig
from rl.experience.rollout import Rollout
from rl.update.logprobs import (
    packed_fused_loss,
    packed_token_stats,
    policy_fused_loss,
    policy_token_stats,
    reference_hidden,
)
from rl.update.micro_batches import gather_tokens, row_lengths, scatter_tokens
from rl.update.shared_layout import (
    LayoutCost,
    _halve,
    budget_pieces,
    members_per_piece,
    plan_shared,
    prompt_keys,
    share_rollout,
    shared_by_row_count,
    shared_by_token_budget,
)

MODEL = dict(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
             max_seq_len=32, tie_embeddings=False)
# rows (not in group order): prompt of group, response length; group 1 has a single row, row 4 no response
GROUPS, RESP, PLEN = [0, 1, 2, 0, 2, 0, 3], [4, 2, 3, 1, 0, 4, 2], {0: 3, 1: 5, 2: 2, 3: 3}


def _rollout(P: int = 5, N: int = 4, seed: int = 0, resp_seed: int = 1, groups=GROUPS, resp=RESP) -> Rollout:
    """Rows of GROUPS with prompts of PLEN tokens (groups 0 and 3: same length, other tokens),
    left-padded to P, and RESP response tokens (drawn from `resp_seed`)."""
    g, gr = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(resp_seed)
    prompts = {k: torch.randint(3, 131, (n,), generator=g, device="cpu") for k, n in PLEN.items()}
    B = len(groups)
    seq = torch.zeros(B, P + N, dtype=torch.long, device="cpu")
    am = torch.zeros(B, P + N, dtype=torch.long, device="cpu")
    rm = torch.zeros(B, N, dtype=torch.bool, device="cpu")
    for i, (k, n) in enumerate(zip(groups, resp)):
        seq[i, P - PLEN[k]:P] = prompts[k]
        seq[i, P:P + n] = torch.randint(3, 131, (n,), generator=gr, device="cpu")
        am[i, P - PLEN[k]:P + n] = 1
        rm[i, :n] = True
    return Rollout(seq, am, rm, P, torch.zeros(B, device="cpu"), torch.arange(B, device="cpu"), [], [])


def _models(tp_group=None, dtype=torch.float64):
    cfg = ModelConfig(**MODEL)
    return build_model(cfg, tp_group, seed=3, dtype=dtype), build_model(cfg, tp_group, seed=4, dtype=dtype)


def test_layout_by_hand():
    ro = _rollout()
    keys = prompt_keys(ro, torch.arange(7, device="cpu"))
    assert keys[0] == keys[3] == keys[5] and keys[2] == keys[4] and len(set(keys)) == 4  # group 3: other tokens
    sh = share_rollout(ro, torch.tensor([3, 1, 0, 4], device="cpu"))  # groups 0 (rows 3, 0) and 2 (row 4: empty)
    s, P = ro.sequences, ro.prompt_len
    # both groups with a response in one row (packed up to twice the median group length): group 0's
    # prompt, row 3's 1 token, row 0's 4; then group 1's 5 prompt + 2 response tokens
    assert sh.input_ids.tolist() == [s[3, 2:6].tolist() + s[0, 5:9].tolist() + s[1, 0:7].tolist()]
    assert sh.document_ids.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4]]
    assert sh.prefix_ids.tolist() == [[0] * 8 + [3] * 7]
    assert sh.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6]]
    assert sh.src_rows.tolist() == [3, 0, 0, 0, 0, 1, 1] and sh.src_cols.tolist() == [0, 0, 1, 2, 3, 0, 1]
    assert sh.head_pos.tolist() == [2, 2, 4, 5, 6, 8 + 4, 8 + 5]  # token 0 of both rows: the prompt's last
    assert sh.targets.tolist() == [s[3, P], *s[0, P:P + 4].tolist(), *s[1, P:P + 2].tolist()]


def test_prefix_mask_reduces_to_document_mask():
    doc = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]], device="cpu")
    assert torch.equal(document_mask_4d(doc, doc), document_mask_4d(doc))
    m = document_mask_4d(torch.tensor([[0, 0, 1, 1, 2, -1]]), torch.tensor([[0, 0, 0, 0, 0, -1]]))[0, 0]
    assert m.tolist()[4] == [True, True, False, False, True, False]  # response 2 sees the prompt, not response 1


def _stats_and_grads(shared: bool, fused: bool, cost=None, **rollout_kw):
    """float64: log-probs, entropy, exact KL [B, N] and every policy gradient of a weighted sum of them; without
    `fused` also the exact KL(rollout || policy) of the reference's hidden states read as a rollout's."""
    torch.manual_seed(0)
    policy, ref = _models()
    ro = _rollout(**rollout_kw)
    B, N = ro.response_mask.shape
    sh = share_rollout(ro, cost=cost) if shared else None
    ref_h, ref_w = reference_hidden(ref, ro.sequences, ro.attention_mask, ro.prompt_len, packed=sh)
    w = torch.randn(3, B, N, dtype=torch.float64, generator=torch.Generator().manual_seed(9), device="cpu")
    kw = dict(vocab_size=131, entropy=True, kl="forward", ref_hidden=ref_h, ref_weight=ref_w,
              mask=ro.response_mask, temperature=0.7, chunk_size=5)
    if fused:
        wt = [gather_tokens(sh, x).reshape(-1) if shared else x.reshape(-1) for x in w]

        def token_loss(lp, ent, kl, t):
            return lp * wt[0][t] + ent * wt[1][t] + kl * wt[2][t]

        if shared:
            from rl.update.logprobs import packed_fused_loss
            kw["ref_hidden"], kw["mask"] = gather_tokens(sh, ref_h), gather_tokens(sh, ro.response_mask)
            loss, _ = packed_fused_loss(policy, sh, token_loss, **kw)
        else:
            loss, _ = policy_fused_loss(policy, ro.sequences, ro.attention_mask, ro.prompt_len, token_loss, **kw)
        stats = None
    else:
        stats = policy_token_stats(policy, ro.sequences, ro.attention_mask, ro.prompt_len, packed=sh,
                                   rollout_hidden=ref_h, **kw)
        assert stats.rollout_kl is not None
        m = ro.response_mask
        loss = sum((x * wi).where(m, 0.0).sum() for x, wi in zip(stats, w))
    loss.backward()
    ref_h = ref_h.where(ro.response_mask[..., None], 0.0)
    return ref_h, stats, loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}


# a long group (prompt 0 drawn for 6 rows: split in pieces that repeat the prompt) beside short ones
LONG = dict(groups=[0, 1, 0, 2, 0, 3, 0, 0, 0, 1], resp=[4, 2, 4, 3, 4, 2, 4, 3, 4, 1])


# attention priced high: the cost plan cuts every group into one-response pieces, a row each
ATTENTION_BOUND = LayoutCost(per_token=1.0, per_score=100.0)


@pytest.mark.parametrize("fused", [False, True], ids=["stats", "fused_loss"])
@pytest.mark.parametrize("case", ["groups", "long_group", "cost_plan"])
def test_shared_equals_padded_float64(fused, case):
    kw = LONG if case != "groups" else {}
    cost = ATTENTION_BOUND if case == "cost_plan" else None
    a, b = _stats_and_grads(False, fused, **kw), _stats_and_grads(True, fused, cost=cost, **kw)
    m = _rollout(**kw).response_mask
    tol = dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(b[0], a[0], **tol)  # reference hidden states at the response tokens
    if not fused:
        for x, y in zip(a[1], b[1]):  # log-probs, entropy, exact KL
            torch.testing.assert_close(y.where(m, 0.0), x.where(m, 0.0), **tol)
    torch.testing.assert_close(b[2], a[2], **tol)
    assert set(a[3]) == set(b[3])
    for k in a[3]:
        assert a[3][k].abs().sum() > 0, k
        torch.testing.assert_close(b[3][k], a[3][k], **tol, msg=lambda s, k=k: f"{k}: {s}")


# LONG's groups: 0 = rows 0 2 4 6 7 8 (3 prompt + 23 response tokens), 1 = rows 1 9 (5 + 3), 2 = row 3 (2 + 3),
# 3 = row 5 (3 + 2). Under a budget of 12, group 0 splits in pieces of prompt + responses <= 12: [0 2] 11,
# [4 6] 11, [7 8] 10; then first-fit decreasing: each of those alone (no room, and 2 x 11 > 12), [1 9] 8
# alone (2 x 8 > 12), [3] and [5] two rows of width 5 (2 x 5 <= 12).
LONG_PLAN_12 = [[[[0, 2]]], [[[4, 6]]], [[[7, 8]]], [[[1, 9]]], [[[3]], [[5]]]]


def _long_plan(budget: int):
    ro = _rollout(**LONG)
    rows = torch.arange(10, device="cpu")
    p, n = (dict(enumerate(x)) for x in row_lengths(ro, rows))
    keys = dict(enumerate(prompt_keys(ro, rows)))
    length = lambda g: p[g[0]] + sum(n[i] for i in g)
    return plan_shared(budget_pieces(list(range(10)), p, n, keys, budget), length, budget), length


def test_budget_plan_by_hand():
    plan, length = _long_plan(12)
    assert plan == LONG_PLAN_12
    plan, length = _long_plan(6)  # 3 + 4 (group 0) and 5 + 2 (row 1): prompt + one response over 6, alone
    over = [mb for mb in plan if len(mb) * max(sum(length(g) for g in r) for r in mb) > 6]
    assert all(len(mb) == 1 and len(mb[0]) == 1 and len(mb[0][0]) == 1 for mb in over)
    assert sorted(mb[0][0][0] for mb in over) == [0, 1, 2, 4, 6, 8]  # row 7 (3 + 3) and row 9 (5 + 1) fit
    assert sorted(i for mb in plan for r in mb for g in r for i in g) == list(range(10))  # every row once
    # halving (DP agreement): layout rows, else one row's pieces, else one piece's responses
    assert _halve([[[3]], [[5]]]) == ([[[3]]], [[[5]]])
    assert _halve([[[1, 9], [3]]]) == ([[[1, 9]]], [[[3]]])
    assert _halve([[[0, 2, 4]]]) == ([[[0]]], [[[2, 4]]])


@pytest.mark.parametrize("cost", [None, "attention_bound"])
def test_budget_plans_of_random_rollouts(cost):
    """200 random rollouts (1-16 rows of 4 prompts, responses of 0-4 tokens) and budgets 5-40: every row
    with a response in exactly one micro-batch, every response token once, and R x W <= budget but for
    a micro-batch of a single row whose prompt + response exceeds it."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        B = int(torch.randint(1, 17, (1,), generator=g))
        groups = torch.randint(0, 4, (B,), generator=g).tolist()
        resp = torch.randint(0, 5, (B,), generator=g).tolist()
        budget = int(torch.randint(5, 41, (1,), generator=g))
        ro = _rollout(groups=groups, resp=resp)
        plan_cost = ATTENTION_BOUND if cost else None  # pieces of fewer responses (one each), same invariants
        mbs = [mb for mb in shared_by_token_budget(ro, torch.randperm(B, generator=g), budget, cost=plan_cost)
               if not mb.filler]
        assert sorted(i for mb in mbs for i in mb.rows.tolist()) == [i for i in range(B) if resp[i] > 0]
        heads = [(r, c) for mb in mbs for r, c in zip(mb.packed.src_rows.tolist(), mb.packed.src_cols.tolist())]
        assert sorted(heads) == [(i, c) for i in range(B) for c in range(resp[i])]
        for mb in mbs:
            i = mb.rows[0].item()
            alone_over = mb.rows.numel() == 1 and PLEN[groups[i]] + resp[i] > budget
            assert mb.packed.input_ids.numel() <= budget or alone_over


@pytest.mark.parametrize("fused", [False, True], ids=["stats", "fused_loss"])
def test_shared_budget_micro_batches_equal_padded_float64(fused):
    """Micro-batches by a 12-token budget in the shared layout (LONG: five of them, group 0 split in
    three pieces that repeat its prompt), each R x W <= 12: log-probs, entropy, exact KL, the loss summed
    over micro-batches and every gradient accumulated over them equal the padded whole-batch forward."""
    a = _stats_and_grads(False, fused, **LONG)
    torch.manual_seed(0)
    policy, ref = _models()
    ro = _rollout(**LONG)
    B, N = ro.response_mask.shape
    mbs = shared_by_token_budget(ro, torch.arange(B, device="cpu"), 12)
    assert [sorted(mb.rows.tolist()) for mb in mbs] == [[0, 2], [4, 6], [7, 8], [1, 9], [3, 5]]
    assert all(mb.packed.input_ids.numel() <= 12 for mb in mbs)
    assert [mb.packed.input_ids.shape for mb in mbs][-1] == (2, 5)
    ref_h, ref_w = reference_hidden(ref, ro.sequences, ro.attention_mask, ro.prompt_len)
    w = torch.randn(3, B, N, dtype=torch.float64, generator=torch.Generator().manual_seed(9), device="cpu")
    kw = dict(vocab_size=131, entropy=True, kl="forward", ref_weight=ref_w, temperature=0.7, chunk_size=5)
    stats, total = [torch.zeros(B, N, dtype=torch.float64) for _ in range(3)], 0.0
    for mb in mbs:
        kw.update(ref_hidden=mb.tokens(ref_h), mask=mb.mask(ro.response_mask))
        wt = [mb.tokens(x).reshape(-1) for x in w]
        if fused:
            def token_loss(lp, ent, kl, t, wt=wt):
                return lp * wt[0][t] + ent * wt[1][t] + kl * wt[2][t]

            loss, _ = packed_fused_loss(policy, mb.packed, token_loss, **kw)
        else:
            st = packed_token_stats(policy, mb.packed, **kw)
            loss = sum((x.reshape(-1) * wi).sum() for x, wi in zip(st, wt))
            for acc, x in zip(stats, st):
                acc += scatter_tokens(mb.packed, x.detach(), B, N)
        loss.backward()
        total = total + loss.detach()
    tol = dict(atol=1e-12, rtol=1e-12)
    if not fused:
        for x, y in zip(a[1], stats):
            torch.testing.assert_close(y, x.where(ro.response_mask, 0.0), **tol)
    torch.testing.assert_close(total, a[2], **tol)
    for k, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, a[3][k], **tol, msg=lambda s, k=k: f"{k}: {s}")


def test_layout_packs_groups_and_splits_a_long_one():
    """Groups of different lengths share rows (first-fit decreasing into the longest group's length)
    and a group over twice the median length is split into pieces repeating its prompt: fewer padded
    tokens than one row per group, every response token once, each piece's responses after its prompt."""
    ro = _rollout(**LONG)
    sh = share_rollout(ro)
    lengths = {0: 3 + 4 * 5 + 3, 1: 5 + 2 + 1, 2: 2 + 3, 3: 3 + 2}  # one row per group: 4 rows x 26
    R, T = sh.input_ids.shape
    assert T <= 2 * sorted(lengths.values())[2] and R * T < 4 * max(lengths.values())
    real = sh.document_ids >= 0
    assert int(real.sum()) > sum(lengths.values())  # the split repeats group 0's prompt
    assert sorted(zip(sh.src_rows.tolist(), sh.src_cols.tolist())) == sorted(
        (i, c) for i, n in enumerate(LONG["resp"]) for c in range(n))
    # every response token's predicting position holds a token of its own row's prompt or response
    flat_src = torch.full((R * T,), -1, dtype=torch.long)
    for r in range(R):
        for t in range(T):
            if real[r, t]:
                flat_src[r * T + t] = int(sh.input_ids[r, t])
    P = ro.prompt_len
    for row, col, hp in zip(sh.src_rows.tolist(), sh.src_cols.tolist(), sh.head_pos.tolist()):
        assert flat_src[hp] == ro.sequences[row, P + col - 1]


def test_isolation_from_other_responses():
    """Row 0's log-probs do not move when the other responses of its group change, and equal its row
    run alone without padding."""
    policy, _ = _models()
    got = []
    for resp_seed in (1, 2):
        ro = _rollout(resp_seed=resp_seed)
        ro.sequences[0] = _rollout(resp_seed=1).sequences[0]  # row 0 itself unchanged
        assert (resp_seed == 1) == torch.equal(ro.sequences[3], _rollout(resp_seed=1).sequences[3])
        st = policy_token_stats(policy, ro.sequences, ro.attention_mask, ro.prompt_len, vocab_size=131,
                                mask=ro.response_mask, packed=share_rollout(ro))
        got.append(st.logprobs[0])
    torch.testing.assert_close(got[1], got[0], atol=0, rtol=0)
    ro = _rollout()
    alone = ro.sequences[:1, 2:]  # row 0 without its padding: 3 prompt + 4 response tokens
    one = policy_token_stats(policy, alone, torch.ones_like(alone), 3, vocab_size=131).logprobs[0]
    torch.testing.assert_close(got[0], one, atol=1e-12, rtol=1e-12)


def test_micro_batches_share_and_fall_back():
    ro = _rollout()
    mbs = shared_by_row_count(ro, torch.tensor([4, 2, 0, 1, 3, 5, 6], device="cpu"), 2)
    assert [m.packed is None for m in mbs] == [False, False, False, False]
    mbs = shared_by_row_count(ro, torch.tensor([4], device="cpu"), 0)  # only an empty response
    assert mbs[0].packed is None  # runs padded (its mask all False): no head token to share
    # "auto" (None): on for GRPO (row or token-budget micro-batches), off for PPO and with packed sequences
    assert AlgoConfig(share_prompts=None).share_prompts and not AlgoConfig(name="ppo", share_prompts=None).share_prompts
    assert AlgoConfig(micro_batch_tokens=64, share_prompts=None).share_prompts
    assert AlgoConfig(micro_batch_tokens=64, share_prompts=True).share_prompts
    assert not AlgoConfig(micro_batch_tokens=64, pack_sequences=True, share_prompts=None).share_prompts
    with pytest.raises(ValueError, match="share_prompts=true does not compose with algo.pack_sequences=true.*"
                                         "algo.pack_sequences=false.*algo.share_prompts=false"):
        AlgoConfig(share_prompts=True, micro_batch_tokens=64, pack_sequences=True)
    assert AlgoConfig().share_prompts  # the default: on for GRPO


def _tp_stats(tp: int):
    from parallel.dims import ParallelDims, init_parallel

    torch.set_num_threads(1)
    state = init_parallel(ParallelDims(1, tp), "cpu", MODEL["n_heads"], MODEL["n_kv_heads"])
    policy, ref = _models(state.tp_group)
    ro = _rollout()
    sh = share_rollout(ro)
    ref_h, ref_w = reference_hidden(ref, ro.sequences, ro.attention_mask, ro.prompt_len, packed=sh)
    st = policy_token_stats(policy, ro.sequences, ro.attention_mask, ro.prompt_len, tp_group=state.tp_group,
                            vocab_size=131, kl="forward", ref_hidden=ref_h, ref_weight=ref_w,
                            mask=ro.response_mask, packed=sh)
    (st.logprobs * ro.response_mask).sum().backward()
    stats = (st.logprobs, st.entropy, st.kl)  # log-probs, entropy, exact KL
    return [t.detach().where(ro.response_mask, 0.0) for t in stats], policy.norm.weight.grad.clone()


@pytest.mark.slow
def test_tp2_equals_tp1(dist_pools):
    ref, g1 = _tp_stats(1)
    for got, g2 in dist_pools.run(2, _tp_stats, 2):
        for x, y in zip(ref, got):  # log-probs, entropy, exact KL
            torch.testing.assert_close(y, x, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(g2, g1, atol=1e-10, rtol=1e-10)  # a replicated parameter's gradient


def _trainer_params(overrides: list[str], plans: list | None = None, old_rows: list | None = None, steps: int = 1):
    from core.tokenizer import load_tokenizer
    from parallel.dims import ParallelDims, init_parallel
    from rl.config import RLConfig
    from rl.train import assemble

    torch.set_num_threads(1)
    base = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=5", "train.steps=1",
            "reward.use_task_reward=false", "reward.fns=[tests.reward_plugins:digits_over_5]", "optim.lr=1e-2",
            "optim.warmup_steps=0", "kl_ctl.beta=0.1", "train.progress=false", "algo.epochs=2",
            "algo.mini_batches=2", "algo.name=grpo", "loss.entropy_coef=0.01", "algo.micro_batch_size=3"]
    cfg = load_config(RLConfig, None, base + overrides)
    mc = ModelConfig(**{**MODEL, "vocab_size": 256, "max_seq_len": 64})
    state = init_parallel(ParallelDims(1, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    policy, ref = (build_model(mc, state.tp_group, seed=11, dtype=torch.float64) for _ in range(2))
    tr = assemble(cfg, state, mc, load_tokenizer(None), policy, ref)
    if plans is not None:  # record each mini-batch's micro-batches
        plan = tr.updater._micro_batches
        tr.updater._micro_batches = lambda data, rows: plans.append(plan(data, rows)) or plans[-1]
    if old_rows is not None:  # record how many rows each old-log-prob forward computes
        stats = tr.heads.token_stats

        def counted(model, ro, packed=None, **kw):
            if not torch.is_grad_enabled():  # the old-log-prob pass (make_experience), not an unfused update
                old_rows.append(ro.sequences.shape[0] if packed is None else len(set(packed.src_rows.tolist())))
            return stats(model, ro, packed=packed, **kw)
        tr.heads.token_stats = counted
    rec = [tr.step(s) for s in range(steps)][-1]
    return {n: p.detach().clone() for n, p in tr.policy.named_parameters()}, rec


@pytest.mark.parametrize("algo", [["kl.estimator=k3+"], ["kl.exact=true", "loss.agg=seq-mean-token-mean"],
                                  ["kl.estimator=k3+", "algo.group_mini_batches=true"]],
                         ids=["k3", "exact", "group_mini_batches"])
@pytest.mark.slow
def test_trainer_step_shared_equals_unshared(algo):
    a, ra = _trainer_params(algo + ["algo.share_prompts=false"])
    b, rb = _trainer_params(algo + ["algo.share_prompts=true"])
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-12, rtol=1e-12, msg=lambda s, k=k: f"{k}: {s}")
    for k in ("kl_mean", "entropy", "pg_loss", "kl_loss", "reward_mean"):
        assert rb[k] == pytest.approx(ra[k], rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize("budget", [14, 34])
@pytest.mark.slow
def test_trainer_step_shared_budget_equals_padded_rows(budget):
    """A whole step (2 epochs x 2 mini-batches, exact KL, seq-mean-token-mean) with share_prompts and
    micro-batches by token budget equals share_prompts=false with row micro-batches, in float64. The
    rows: prompts of 6-7 tokens, 5 response tokens, 2 rows of each prompt per mini-batch (groups of 16-17
    tokens). Budget 14 splits every group in two pieces repeating the prompt, one per micro-batch; 34
    puts two groups in the two rows of each micro-batch. Every micro-batch's R x W <= the budget."""
    algo = ["kl.exact=true", "loss.agg=seq-mean-token-mean"]
    a, ra = _trainer_params(algo + ["algo.share_prompts=false"])
    plans: list = []
    b, rb = _trainer_params(algo + ["algo.share_prompts=true", "algo.micro_batch_size=0",
                                    f"algo.micro_batch_tokens={budget}"], plans)
    mbs = [mb for plan in plans for mb in plan]
    assert len(plans) == 4 and all(len(plan) > 1 for plan in plans)
    assert all(not mb.filler and mb.packed.input_ids.numel() <= budget for mb in mbs)
    rows = sorted(i for mb in plans[0] for i in mb.rows.tolist())
    assert rows == sorted(set(rows)) and len(rows) == 8  # each row of the mini-batch once
    if budget == 14:  # each group's 2 rows in 2 pieces, each its prompt and one response, alone: [1, p + 5]
        assert all(len(plan) == 8 for plan in plans)
        assert all(mb.rows.numel() == 1 and mb.packed.input_ids.shape in ((1, 11), (1, 12)) for mb in mbs)
    else:  # two whole groups, one per row: [2, 17] (or [2, 16] for the 6-token prompt's)
        assert all(len(plan) == 2 for plan in plans)
        assert all(mb.rows.numel() == 4 and mb.packed.input_ids.shape[0] == 2 for mb in mbs)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-12, rtol=1e-12, msg=lambda s, k=k: f"{k}: {s}")
    for k in ("kl_mean", "entropy", "pg_loss", "kl_loss", "reward_mean", "clipfrac", "ratio_mean"):
        assert rb[k] == pytest.approx(ra[k], rel=1e-9, abs=1e-12), k


def test_shared_prefill_samples_the_same_tokens():
    policy, _ = _models(dtype=torch.float32)
    ro = _rollout()
    P = ro.prompt_len
    ids, mask = ro.sequences[:, :P], ro.attention_mask[:, :P]
    outs = [generate(policy, ids, mask, max_new_tokens=6, eos_id=None, pad_id=0, temperature=1.0, seed=5,
                     row_ids=torch.arange(7, device="cpu") * 3, share_prefill=share) for share in (False, True)]
    assert torch.equal(outs[1].sequences, outs[0].sequences)
    assert torch.equal(outs[1].response_mask, outs[0].response_mask)
    assert len({tuple(r) for r in outs[0].sequences[:, P:].tolist()}) > 4  # a group's rows drew different tokens


@pytest.mark.parametrize("algo", [["kl.estimator=k3+"], ["kl.exact=true", "loss.agg=seq-mean-token-mean"],
                                  ["kl.estimator=k3+", "algo.share_prompts=false"],
                                  ["kl.estimator=k3+", "algo.mini_batches=1", "algo.epochs=1"],
                                  ["kl.exact=true", "algo.micro_batch_size=0", "algo.micro_batch_tokens=14"],
                                  ["kl.exact=true", "algo.fused_loss=false", "algo.share_prompts=false"]],
                         ids=["k3", "exact", "padded", "one_mini_batch", "token_budget", "unfused"])
@pytest.mark.slow
def test_old_values_from_the_on_policy_update_equal_the_old_pass(algo):
    """algo.old_from_update: epoch 0's first mini-batch takes its old log-probs, entropy and exact KL from
    its own update forward, the old-log-prob pass computes the other rows only (none with one mini-batch).
    Two whole steps in float64 against every row through the pass: the same parameters after each epoch's
    optimizer steps, the same KL (policy != reference in the second step) and entropy metrics."""
    rows_all, rows_rest = [], []
    a, ra = _trainer_params(algo + ["algo.old_from_update=false", "train.steps=2"], old_rows=rows_all, steps=2)
    b, rb = _trainer_params(algo + ["algo.old_from_update=true", "train.steps=2"], old_rows=rows_rest, steps=2)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-12, rtol=1e-12, msg=lambda s, k=k: f"{k}: {s}")
    for k in ("kl_mean", "kl_p90", "kl_max", "entropy", "pg_loss", "kl_loss", "approx_kl_old", "ratio_mean"):
        assert rb[k] == pytest.approx(ra[k], rel=1e-9, abs=1e-12), k
    assert ra["kl_mean"] > 1e-6 and ra["entropy"] > 0
    n_rows = 16  # 4 prompts x 4 samples
    assert rows_all == [n_rows] * 2
    assert rows_rest == ([] if "algo.mini_batches=1" in algo else [n_rows // 2] * 2)
    assert rb["logp_drift"] == 0.0 and 0.0 <= ra["logp_drift"] < 1e-12  # measured only where the pass ran


def test_layout_cost_plan_by_hand():
    """The plan the cost model picks. Responses of 4 after a 3-token prompt: one row of 19 tokens costs
    19 (+ 361 per-score units), two pieces of 11 cost 22 (+ 242), four of 7 cost 28 (+ 196): with no
    attention cost the whole group stays one piece, with attention priced the responses go one per row.
    On LONG's rollout: free attention keeps the default plan exactly; costly attention gives one response
    per row (R = the rows with a response, W = the longest prompt + response), modelled under 0.9x."""
    assert members_per_piece(3, [4, 4, 4, 4], LayoutCost(1.0, 0.0)) == 4
    assert members_per_piece(3, [4, 4, 4, 4], LayoutCost(1.0, 1.0)) == 1
    # 0.05 per score: two pieces 34.1 against 37.05 whole, 0.92x, not under the 0.9 margin: whole
    assert members_per_piece(3, [4, 4, 4, 4], LayoutCost(1.0, 0.05)) == 4
    # 0.1: two pieces 46.2 against 55.1 whole (0.84x) and 47.6 one response each
    assert members_per_piece(3, [4, 4, 4, 4], LayoutCost(1.0, 0.1)) == 2
    ro = _rollout(**LONG)
    default, free = share_rollout(ro), share_rollout(ro, cost=LayoutCost(1.0, 0.0))
    for f in ("input_ids", "position_ids", "document_ids", "prefix_ids", "head_pos", "src_rows", "src_cols"):
        assert torch.equal(getattr(free, f), getattr(default, f)), f
    tiny = LayoutCost.of(ModelConfig(**{**MODEL, "hidden_size": 64, "intermediate_size": 176}))
    assert tiny.attention_share(default.input_ids.shape[1]) < 0.25  # short rows: the default, outright
    assert torch.equal(share_rollout(ro, cost=tiny).input_ids, default.input_ids)
    split = share_rollout(ro, cost=ATTENTION_BOUND)
    R, W = split.input_ids.shape
    p, n = row_lengths(ro, torch.arange(10, device="cpu"))
    assert R == sum(x > 0 for x in n) and W == max(a + b for a, b in zip(p, n))
    assert ATTENTION_BOUND(R, W) <= 0.9 * ATTENTION_BOUND(*default.input_ids.shape)
    assert sorted(zip(split.src_rows.tolist(), split.src_cols.tolist())) == sorted(
        zip(default.src_rows.tolist(), default.src_cols.tolist()))  # the same response tokens, once each
