"""The RL step against a single-process reference: GRPO and PPO updates do not depend on the
tp x dp layout; the first on-policy mini-batch has ratio exactly 1; bad rewards stop every rank."""

import math

import pytest
import torch

from core.config import ModelConfig, load_config
from core.model import build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from rl.config import RLConfig
from rl.models.critic import Critic

MODEL = dict(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
             max_seq_len=64)
BASE = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=2",
        "reward.use_task_reward=false", "reward.fns=[tests.reward_plugins:digits_over_6]", "optim.lr=1e-2",
        "optim.warmup_steps=0", "optim.grad_clip=0.5", "kl_ctl.beta=0.1", "train.progress=false",
        # AdamW's eps above rounding noise: with 1e-8, a gradient component that is 0 up to rounding
        # (~1e-12, its sign set by summation order) is normalised to a full +-lr step, which turns
        # last-bit layout differences into lr-sized weight differences; 1e-6 leaves real gradients be
        "optim.eps=1e-6"]


def _trainer(tp, dp, overrides, dtype=torch.float32):
    from rl.train import assemble

    cfg = load_config(RLConfig, None, BASE + list(overrides))
    mc = ModelConfig(**MODEL)
    state = init_parallel(ParallelDims(dp, tp), "cpu", mc.n_heads, mc.n_kv_heads)
    kv = kv_replica_group(state, mc.n_kv_heads)
    policy = build_model(mc, state.tp_group, kv, seed=11, dtype=dtype)
    ref = build_model(mc, state.tp_group, kv, seed=11, dtype=dtype)
    critic = None
    if cfg.algo.name == "ppo":
        critic = Critic(mc, state.tp_group, kv, dtype=dtype)
        critic.body.init_weights(11)
    return assemble(cfg, state, mc, load_tokenizer(None), policy, ref, critic), state


STEP_KEYS = ("reward_mean", "kl_mean", "kl_p50", "kl_p90", "kl_p99", "pg_loss", "grad_norm", "entropy", "ratio_mean",
             "clipfrac", "logp_drift", "kl_loss")


def _steps_and_logits(tp, dp, overrides, keys=STEP_KEYS, optional=()):
    """Two float64 steps at tp x dp: each step's metrics `keys` (those in `optional` only where the step
    records them) and the logits of a fixed batch after them, gathered over tp."""
    from parallel.comm import gather_from_tp

    # float64: a layout's rounding order stays ~1e-16, so 2 clipped AdamW steps cannot magnify it to the tolerance
    trainer, state = _trainer(tp, dp, overrides, dtype=torch.float64)
    recs = [trainer.step(s) for s in range(2)]
    ids = torch.arange(3, 3 + 2 * 12).view(2, 12) % 250 + 3
    with torch.no_grad():
        logits = gather_from_tp(trainer.policy(ids), state.tp_group)[..., :256]
    return [{k: r[k] for k in keys if k in r or k not in optional} for r in recs], logits


def _compare(single, got):
    recs0, logits0 = single
    recs, logits = got
    for a, b in zip(recs0, recs):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k
    torch.testing.assert_close(logits, logits0, atol=1e-5, rtol=1e-5)


# the old-log-prob pass over every row here, so that `logp_drift` measures it against the update's; EXACT runs
# the default, its first mini-batch's old values from the update (algo.old_from_update)
GRPO = ["algo.name=grpo", "kl.estimator=k3+", "loss.entropy_coef=0.01", "algo.old_from_update=false"]
PPO = ["algo.name=ppo", "kl.where=reward", "kl.estimator=k1", "algo.mini_batches=2"]
EXACT = ["algo.name=grpo", "kl.exact=true", "algo.mini_batches=2", "algo.epochs=2"]


@pytest.fixture(scope="module")
def singles():
    torch.set_num_threads(1)
    return {name: _steps_and_logits(1, 1, ov) for name, ov in (("grpo", GRPO), ("ppo", PPO), ("exact", EXACT))}


def test_first_minibatch_is_on_policy_and_update_moves(singles):
    recs, _ = singles["grpo"]
    assert recs[0]["ratio_mean"] == 1.0 and recs[0]["clipfrac"] == 0.0
    assert recs[0]["logp_drift"] < 1e-5  # rollout-time and update-time log-probs agree
    assert recs[0]["kl_mean"] == 0.0  # policy == reference before the first update
    assert recs[1]["kl_mean"] > 0.0 and recs[0]["grad_norm"] > 0.0


def test_exact_kl_and_two_epochs(singles):
    recs, _ = singles["exact"]
    # policy == reference at step 0: 0 up to fp32 rounding of the KL's sum (~1e-8 here; the first mini-batch's KL
    # comes from the update's forward, another layout than the reference pass's: algo.old_from_update), against
    # ~1e-2 at step 1
    assert abs(recs[0]["kl_mean"]) < 1e-6 and recs[1]["kl_mean"] > 1e-3
    assert recs[1]["kl_p99"] >= recs[1]["kl_p50"] >= 0.0  # the exact KL is never negative


@pytest.mark.slow
def test_layouts_match_single_process_tp2(dist_pools, singles):
    for name, ov in (("grpo", GRPO), ("ppo", PPO), ("exact", EXACT)):
        res = dist_pools.run(2, _steps_and_logits, 2, 1, ov)
        _compare(singles[name], res[0])


@pytest.mark.slow
def test_layouts_match_single_process_dp2(dist_pools, singles):
    for name, ov in (("grpo", GRPO), ("ppo", PPO)):
        res = dist_pools.run(2, _steps_and_logits, 1, 2, ov)
        _compare(singles[name], res[0])
        _compare(singles[name], res[1])


@pytest.mark.slow
def test_layout_tp2_dp2(dist_pools, singles):
    res = dist_pools.run(4, _steps_and_logits, 2, 2, GRPO)
    for r in res:
        _compare(singles["grpo"], r)


def _collective_kinds(overrides) -> set:
    from parallel.comm import count_comm

    trainer, _ = _trainer(2, 1, overrides)
    with count_comm() as c:
        trainer.step(0)
    return set(c.by_kind())


@pytest.mark.slow
def test_sequence_parallel_step_matches_single_process(dist_pools, singles):
    """parallel.sequence_parallel=true at tp=2: GRPO (shared prompts), PPO (the critic's body too) and the exact KL
    as the single process without it; packed sequences and the batch-invariant mode as the same layout without it."""
    sp = ["parallel.sequence_parallel=true"]
    assert "reduce_scatter:sum" in dist_pools.run(2, _collective_kinds, PPO + sp)[0], "the step ran without SP"
    for name, ov in (("grpo", GRPO), ("ppo", PPO), ("exact", EXACT)):
        _compare(singles[name], dist_pools.run(2, _steps_and_logits, 2, 1, ov + sp)[0])
    packed = GRPO + ["algo.share_prompts=false", "algo.micro_batch_tokens=40", "algo.pack_sequences=true"]
    invariant = GRPO + ["parallel.batch_invariant=true"]  # shared prompts under the batch-invariant layouts
    for ov in (packed, invariant):
        off = dist_pools.run(2, _steps_and_logits, 2, 1, ov)[0]
        _compare(off, dist_pools.run(2, _steps_and_logits, 2, 1, ov + sp)[0])


def _nan_reward_everywhere():
    import torch.distributed as dist

    trainer, _ = _trainer(1, 2, ["reward.fns=[tests.reward_plugins:nan_on_prompts_from_1]",
                                 "rollout.prompts_per_step=8"])
    try:
        trainer.step(0)
    except ValueError as e:
        return f"rank {dist.get_rank()}: {e}"
    return "no error"


@pytest.mark.slow
def test_nan_reward_stops_every_rank(dist_pools):
    msgs = dist_pools.run(2, _nan_reward_everywhere)
    assert all("is nan" in m or "another rank failed" in m for m in msgs), msgs
    assert any("for prompt" in m and "sample" in m for m in msgs), msgs


@pytest.mark.slow
def test_early_stop_of_update_epochs():
    torch.set_num_threads(1)
    trainer, _ = _trainer(1, 1, GRPO + ["algo.epochs=4", "algo.mini_batches=2", "algo.early_stop_kl=1e-12",
                                        "optim.lr=1e-1"])
    rec = trainer.update(trainer.make_experience(0), 0)
    assert rec["early_stopped"] and rec["optimizer_steps"] == 2  # one epoch, then the drift check stops it
    trainer, _ = _trainer(1, 1, GRPO + ["algo.epochs=4", "algo.mini_batches=2"])
    rec = trainer.update(trainer.make_experience(0), 0)
    assert not rec["early_stopped"] and rec["optimizer_steps"] == 8


@pytest.mark.slow
def test_fused_loss_equals_recomputing_head(singles):
    """The default update (policy loss inside the fused head, gradient formed in forward) takes the
    same steps as autograd through the recomputing fused head and rl.objectives.losses.policy_loss."""
    for name, ov in (("grpo", GRPO), ("ppo", PPO), ("exact", EXACT)):
        _compare(singles[name], _steps_and_logits(1, 1, ov + ["algo.fused_loss=false"]))


def _with_padding(data, garbage: bool):
    """`data` with its last response column turned into padding: either kept, masked, and filled with
    garbage (NaN old log-prob, log(pi/ref) = -200, -inf advantage), or removed altogether."""
    import dataclasses

    from rl.experience.rollout import Rollout

    ro = data.ro
    if garbage:
        mask = data.mask.clone()
        mask[:, -1] = False
        old, ref, adv = data.old_logp.clone(), data.ref_logp.clone(), data.advantages.clone()
        old[0, -1], adv[2, -1] = math.nan, -math.inf
        ref[1, -1] = old[1, -1] + 200.0
        ref[3, -1] = math.nan
        ro2 = Rollout(ro.sequences, ro.attention_mask, mask, ro.prompt_len, ro.scores, ro.row_ids, ro.metas, [])
        return dataclasses.replace(data, ro=ro2, mask=mask, old_logp=old, ref_logp=ref, advantages=adv)
    cut = lambda t: None if t is None else t[:, :-1]
    ro2 = Rollout(ro.sequences[:, :-1], ro.attention_mask[:, :-1], ro.response_mask[:, :-1], ro.prompt_len,
                  ro.scores, ro.row_ids, ro.metas, [])
    return dataclasses.replace(data, ro=ro2, mask=cut(data.mask), old_logp=cut(data.old_logp),
                               ref_logp=cut(data.ref_logp), ref_hidden=cut(data.ref_hidden), kl=cut(data.kl),
                               entropy=cut(data.entropy), advantages=cut(data.advantages))


@pytest.mark.parametrize("ov", [["kl.estimator=k3"], ["algo.fused_loss=false"]])
@pytest.mark.slow
def test_update_ignores_garbage_at_padding(ov):
    """Through RLTrainer.update (two epochs x two mini-batches, so old log-probs matter): NaN, -inf
    and a log-ratio of -200 at padded positions leave the step finite, not skipped, and equal to
    the step on the same data with the padding removed."""
    torch.set_num_threads(1)
    over = GRPO + ["algo.epochs=2", "algo.mini_batches=2", "kl_ctl.beta=0.5"] + ov
    a, _ = _trainer(1, 1, over)
    b, _ = _trainer(1, 1, over)
    data = a.make_experience(0)
    ra = a.update(_with_padding(data, True), 0)
    rb = b.update(_with_padding(data, False), 0)
    assert ra["skipped"] == 0 and math.isfinite(ra["grad_norm"]) and math.isfinite(ra["pg_loss"])
    assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-5)
    # four AdamW steps (lr 1e-2) on differently shaped but equal fp32 problems: rounding noise only
    for (n, p), q in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert float((p - q).abs().max()) < 1e-4, n


@pytest.mark.slow
def test_adaptive_controller_clock_through_the_trainer():
    """KL held at 10x the target: each step multiplies beta by 1 + 0.2 * n / horizon with n the
    step's samples (prompts_per_step x group_size = 16), Ziegler et al.'s clock."""
    torch.set_num_threads(1)
    trainer, _ = _trainer(1, 1, GRPO + ["kl_ctl.mode=adaptive", "kl_ctl.beta=0.1", "kl_ctl.target=0.05",
                                        "kl_ctl.horizon=64", "train.steps=3"])
    real = trainer.make_experience

    def fixed_kl(step):
        data = real(step)
        data.kl = torch.where(data.mask, 0.5, 0.0)
        return data

    trainer.make_experience = fixed_kl
    for s in range(3):
        rec = trainer.step(s)
        assert rec["kl_mean"] == pytest.approx(0.5)
        assert rec["beta_next"] == pytest.approx(0.1 * (1 + 0.2 * 16 / 64) ** (s + 1), rel=1e-12)


def test_mini_batch_split_matches_the_per_row_definition():
    """The split by global row id against its definition written out row by row: within each prompt's
    group a permutation keyed by (seed, step, epoch, prompt), global position p to mini-batch p mod n."""
    from parallel.dims import derive_seed
    from rl.update.mini_batches import mini_batches

    trainer, _ = _trainer(1, 1, GRPO + ["algo.mini_batches=4", "rollout.group_size=4"])
    G, n = 4, 4
    row_ids = torch.tensor([5, 0, 7, 12, 3, 9, 14, 1, 2, 8, 6, 15, 4, 13, 10, 11])  # 4 prompts, shuffled
    for step, epoch in ((0, 0), (3, 1)):
        want = [[] for _ in range(n)]
        for i, rid in enumerate(row_ids.tolist()):
            prompt, j = divmod(rid, G)
            g = torch.Generator().manual_seed(derive_seed(trainer.cfg.train.seed, step, epoch, prompt))
            want[(prompt * G + int(torch.randperm(G, generator=g)[j])) % n].append(i)
        got = mini_batches(trainer.cfg, row_ids, step, epoch, "cpu")
        assert [g.tolist() for g in got] == want
