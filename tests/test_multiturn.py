"""Multi-turn rollouts (rl/experience/episodes.py, core/generation/multiturn.py): the ids trained on
are exactly the ids sampled plus the ids appended; the KV-cache continuation scores what a fresh
forward of the whole episode scores; appended (observation) tokens reach no gradient."""

from __future__ import annotations

import pytest
import torch

from core.config import ModelConfig, load_config
from core.generation import multiturn as mt
from core.generation.generate import Stopper as _Stopper
from core.model import build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel
from rl.config import RLConfig
from rl.envs.base import Turn
from rl.experience.episodes import collect_episodes, render_observation
from rl.experience.tasks import make_task

CFG = ModelConfig(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                  max_seq_len=96)
LOG: list = []  # (row meta prompt, turn, ids, observation) of every `recording_env` step


class _Recording:
    def __init__(self, meta: dict, done_at: int = 2):
        self.meta, self.done_at, self.turn = meta, done_at, 0

    def step(self, text: str, ids: list[int]) -> Turn:
        obs = f"t{self.turn}x{len(ids)}"
        LOG.append((id(self), self.turn, list(ids), obs))
        done = self.turn >= self.done_at or (sum(ids) % 3 == 0 and self.turn > 0)
        self.turn += 1
        return Turn(obs, float(sum(ids) % 5) / 4, done=done)


def recording_env(meta: dict, done_at: int = 2):
    return _Recording(meta, done_at)


def _rollout_cfg(**kw):
    base = dict(prompts_per_step=2, group_size=3, max_new_tokens=4, env="tests.test_multiturn:recording_env",
                max_turns=4, max_obs_tokens=8, record_hidden=False, stop=["="])
    return RLConfig().rollout.__class__(**{**base, **kw})


def test_ids_trained_on_are_sampled_plus_appended():
    """Each row's response region is, in order, its turns' sampled ids and the ids of its rendered
    observations encoded on their own; response_mask is 1 exactly on the sampled ids."""
    tok = load_tokenizer(None)
    model = build_model(CFG, seed=3)
    LOG.clear()
    ro = collect_episodes(model, tok, make_task("arithmetic", max_operand=9), _rollout_cfg(), seed=5, step=0)
    episodes: dict = {}
    for ep, turn, ids, obs in LOG:
        episodes.setdefault(ep, []).append((turn, ids, obs))
    assert len(episodes) == ro.sequences.shape[0]
    P, eos = ro.prompt_len, set(tok.eos_ids if getattr(tok, "eos_ids", None) else [tok.eos_id])
    turns_seen = set()
    for r, steps in enumerate(episodes.values()):  # episodes start in row order
        want, want_mask = [], []
        for k, (_, ids, obs) in enumerate(steps):
            want += ids
            want_mask += [True] * len(ids)
            if k < len(steps) - 1:  # an observation is appended only when another turn follows
                app = tok.encode(render_observation(tok, obs, ids[-1] if ids and ids[-1] in eos else None))
                want += app
                want_mask += [False] * len(app)
        turns_seen.add(len(steps))
        real = ro.attention_mask[r, P:].bool()
        assert ro.sequences[r, P:][real].tolist() == want
        assert ro.response_mask[r][real].tolist() == want_mask
        assert not ro.response_mask[r][~real].any()
        assert int(real.sum()) == len(want) and bool(real[:len(want)].all())  # no holes in the trained layout
    assert max(turns_seen) > 1  # some episode really had several turns


def test_retokenised_conversation_differs():
    """Re-tokenising the final conversation's text does not give back the ids the model sampled and was
    fed: a trainer that re-tokenised would score tokens the policy never drew (see docs/design.md)."""
    tok = load_tokenizer(None)
    model = build_model(CFG, seed=3)
    ro = collect_episodes(model, tok, make_task("arithmetic", max_operand=9), _rollout_cfg(), seed=5, step=0)
    P, differ = ro.prompt_len, 0
    for r in range(ro.sequences.shape[0]):
        ids = ro.sequences[r, P:][ro.attention_mask[r, P:].bool()].tolist()
        again = tok.encode(tok.decode(ids))
        first = next((i for i, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
        differ += int(ids != again)
        if ids != again:
            assert first < max(len(ids), len(again))
    assert differ > 0


def test_kv_continuation_matches_full_forward():
    """After decode - append (blocks of unequal lengths, one empty) - decode, each row's next-token
    logits from the cache equal a fresh float64 forward over the row's hole-free episode."""
    torch.manual_seed(0)
    model = build_model(CFG, seed=4).double()
    B, P = 4, 5
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[0, :2] = 0
    mask[2, :1] = 0
    conv = mt.start(model, ids, mask, columns=30, pad_id=0)
    kw = dict(vocab_size=CFG.vocab_size, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1, step=0)
    stop = _Stopper({7, 9, 11}, None, None, "cpu")
    budget = torch.full((B,), 30)
    rows = torch.arange(B)
    mt.decode(model, conv, torch.tensor([True, True, False, True]), max_new_tokens=3, budget=budget, stopper=stop,
              sample_kw=kw, row_ids=rows)
    mt.append(model, conv, [[5, 6, 7, 8], [], [9], [10, 11]])
    mt.decode(model, conv, torch.tensor([True, False, True, True]), max_new_tokens=2, budget=budget, stopper=stop,
              sample_kw=kw, row_ids=rows)
    out = mt.finish(conv)
    am = out["attention_mask"]
    assert bool(((am[:, P:].cumsum(1) == torch.arange(1, am.shape[1] - P + 1)) | (am[:, P:] == 0)).all())
    with torch.no_grad():
        full = model(out["sequences"], attention_mask=am)
    last = am.shape[1] - 1 - am.flip(1).argmax(1)  # each row's last real column
    ref = full[torch.arange(B), last]
    assert full.dtype == torch.float64 and conv.logits.dtype == torch.float64
    torch.testing.assert_close(conv.logits, ref, rtol=1e-10, atol=1e-10)


def _trainer(extra=()):
    # Adam with eps far above |g|: its first step is -lr * g / eps, linear in the gradient (no sign-like
    # amplification of gradients that are zero up to rounding)
    overrides = ["reward.task=arithmetic", "rollout.env=tests.test_multiturn:recording_env", "rollout.max_turns=3",
                 "rollout.max_new_tokens=3", "optim.eps=1.0e4", "optim.weight_decay=0.0", "optim.grad_clip=1.0e9",
                 "rollout.max_obs_tokens=6", "rollout.prompts_per_step=2", "rollout.group_size=4",
                 "rollout.record_hidden=false", "train.progress=false", "train.steps=4", "optim.lr=1.0",
                 "optim.warmup_steps=0", "algo.name=grpo", "algo.epochs=1", "algo.mini_batches=1",
                 "kl_ctl.beta=0.1", "train.seed=3",
                 "algo.old_from_update=false", "parallel.tp=1", "parallel.dp=1", *extra]
    from rl.train import assemble
    cfg = load_config(RLConfig, None, overrides)
    mc = ModelConfig(**{**CFG.__dict__, "max_seq_len": 64})
    state = init_parallel(ParallelDims(1, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    return assemble(cfg, state, mc, load_tokenizer(None), build_model(mc, seed=2), build_model(mc, seed=2))


def _perturbed_update(extra, where: str):
    """Parameters after one update of the same experience, with every per-token input of the loss and
    the KL (old / reference / rollout log-probs, KL, entropy, advantages) moved at `where` positions."""
    tr = _trainer(extra)
    data = tr.make_experience(0)
    ro = data.ro
    region = ro.attention_mask[:, ro.prompt_len:].bool()
    pos = (region & ~ro.response_mask) if where == "observation" else ro.response_mask.clone()
    if where == "none":
        pos[:] = False
    for name, shift in (("old_logp", 0.7), ("ref_logp", -1.3), ("kl", 2.0), ("entropy", 1.5), ("advantages", 3.0),
                        ("rollout_logprobs", -0.4), ("rollout_sampled_logprobs", -0.2)):
        t = getattr(data, name)
        if t is not None:
            setattr(data, name, torch.where(pos, t + shift, t))
    tr.update(data, 0)
    return {n: p.detach().clone() for n, p in tr.policy.named_parameters()}, int(pos.sum())


KL_PLACES = {"k3+_loss": ["kl.estimator=k3+", "kl.where=loss"],
             "exact_loss": ["kl.exact=true", "kl.where=loss"],
             "k3+_sequence_loss": ["kl.estimator=k3+", "kl.where=loss", "kl.gradient=sequence"],
             "k1_reward": ["kl.estimator=k1", "kl.where=reward"]}


@pytest.mark.parametrize("place", sorted(KL_PLACES))
def test_observation_tokens_reach_no_gradient(place):
    """Moving the loss's and the KL's inputs at observation positions leaves the update unchanged
    (bitwise); moving them at sampled positions changes it (the check can fail). Every KL place:
    the estimator or the exact KL, in the loss (token or sequence gradient) or in the reward."""
    extra = KL_PLACES[place]
    base, _ = _perturbed_update(extra, "none")
    obs, n_obs = _perturbed_update(extra, "observation")
    resp, _ = _perturbed_update(extra, "response")
    assert n_obs > 0
    assert all(torch.equal(base[n], obs[n]) for n in base)
    assert any(not torch.equal(base[n], resp[n]) for n in base)


LAYOUTS = {"rows": ["algo.share_prompts=false"], "shared": ["algo.share_prompts=true"],
           "shared_tokens": ["algo.share_prompts=true", "algo.micro_batch_tokens=48"],
           "packed": ["algo.share_prompts=false", "algo.micro_batch_tokens=64", "algo.pack_sequences=true"]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_score_episodes_with_holes(layout):
    """Responses with holes in response_mask (observations inside the response region): every update
    layout's old log-probs equal what the sampler recorded while continuing its KV cache (so each
    layout conditions on the observations as the rollout did), and the update equals the plain one."""
    tr = _trainer(LAYOUTS[layout])
    data = tr.make_experience(0)
    ro = data.ro
    holes = ro.attention_mask[:, ro.prompt_len:].bool() & ~ro.response_mask
    assert holes.any()
    m = data.mask
    torch.testing.assert_close(data.old_logp[m], data.rollout_logprobs[m], rtol=0, atol=2e-5)
    got = _delta(tr, data)
    ref = _trainer(LAYOUTS["rows"])
    want = _delta(ref, ref.make_experience(0))
    scale = max(float(d.abs().max()) for d in want.values())
    assert scale > 0
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-4 * scale, msg=n)


def _delta(tr, data) -> dict:
    """Each parameter's change in one update (linear in its gradient: see `_trainer`)."""
    before = {n: p.detach().clone() for n, p in tr.policy.named_parameters()}
    tr.update(data, 0)
    return {n: p.detach() - before[n] for n, p in tr.policy.named_parameters()}


DIST = ["reward.task=arithmetic", "rollout.env=tests.test_multiturn:recording_env", "rollout.max_turns=3",
        "rollout.max_new_tokens=3", "rollout.max_obs_tokens=6", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.record_hidden=false", "train.progress=false", "train.steps=2", "optim.lr=1e-2",
        "optim.warmup_steps=0", "optim.eps=1e-6", "optim.grad_clip=0.5", "algo.name=grpo", "kl.estimator=k3+",
        "kl_ctl.beta=0.1", "train.seed=3", "algo.old_from_update=false"]


def _multiturn_steps(tp: int, dp: int):
    """Two multi-turn GRPO steps in float64 on a tp x dp layout -> (records, logits of fixed ids)."""
    from parallel.comm import gather_from_tp
    from parallel.dims import kv_replica_group
    from rl.train import assemble

    torch.set_num_threads(1)
    cfg = load_config(RLConfig, None, DIST)
    mc = ModelConfig(**{**CFG.__dict__, "max_seq_len": 64})
    state = init_parallel(ParallelDims(dp, tp), "cpu", mc.n_heads, mc.n_kv_heads)
    kv = kv_replica_group(state, mc.n_kv_heads)
    policy, ref = (build_model(mc, state.tp_group, kv, seed=11, dtype=torch.float64) for _ in range(2))
    tr = assemble(cfg, state, mc, load_tokenizer(None), policy, ref)
    recs = [tr.step(s) for s in range(2)]
    ids = torch.arange(3, 27).view(2, 12) % 250 + 3
    with torch.no_grad():
        logits = gather_from_tp(tr.policy(ids), state.tp_group)[..., :256]
    keys = ("reward_mean", "kl_mean", "pg_loss", "grad_norm", "entropy", "env_turns", "response_len")
    return [{k: r[k] for k in keys} for r in recs], logits


@pytest.mark.slow
def test_multiturn_step_tp2_dp2_equals_single_process(dist_pools):
    """Episodes, masks and the update do not depend on the layout: tp 2 x dp 2 against one process."""
    recs0, logits0 = _multiturn_steps(1, 1)
    assert recs0[0]["env_turns"] > 1.0
    for recs, logits in dist_pools.run(4, _multiturn_steps, 2, 2):
        for a, b in zip(recs0, recs):
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), k
        torch.testing.assert_close(logits, logits0, atol=1e-9, rtol=1e-9)


class _Stuck:
    def __init__(self, meta):
        self.meta = meta

    def step(self, text, ids):
        if ids:  # every turn with tokens loops forever: the bound must stop it
            while True:
                pass
        return Turn("", 0.0, done=True)


def stuck_env(meta):
    return _Stuck(meta)


def broken_env(meta):
    raise KeyError("no field 'target'")


@pytest.mark.parametrize("spec,expect", [("tests.test_multiturn:stuck_env", "EnvTimeout"),
                                         ("tests.test_multiturn:broken_env", "start: KeyError")])
def test_environment_failures_are_named(spec, expect):
    """A step past reward.timeout_s, or a factory that raises, stops the rollout naming the plug-in,
    the prompt and the turn."""
    tok = load_tokenizer(None)
    model = build_model(CFG, seed=3)
    cfg = _rollout_cfg(env=spec, prompts_per_step=1, group_size=2)
    with pytest.raises(ValueError) as e:
        collect_episodes(model, tok, make_task("arithmetic", max_operand=9), cfg, seed=5, step=0, timeout_s=0.3)
    msg = str(e.value)
    assert spec in msg and expect in msg and "prompt '" in msg, msg


class _ChatTok:
    """A tokenizer's chat side: Qwen2.5's tools template (tests/chat_templates.py), EOS id 7 = <|im_end|>."""

    def __init__(self):
        from tests.chat_templates import QWEN25_TOOLS
        self.chat_template = QWEN25_TOOLS

    def render_chat(self, messages, add_generation_prompt=True):
        from core.chat_template import render_chat_template
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt)

    def id_to_piece(self, i):
        return {7: "<|im_end|>"}.get(i)


def test_chat_observation_has_the_templates_turn_markers():
    """With a chat template, the appended text closes the assistant turn (less the EOS the model sampled),
    holds the observation in the template's tool turn, and opens the next assistant turn."""
    tok = _ChatTok()
    tool_turn = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert render_observation(tok, "42", eos_sampled=7) == "\n" + tool_turn
    assert render_observation(tok, "42") == "<|im_end|>\n" + tool_turn  # the turn ended on a stop string
    assert render_observation(load_tokenizer(None), "42") == " 42 "


@pytest.mark.slow
def test_bench_puts_the_same_tokens_through_both_rollouts():
    """bench/bench_multiturn.py compares like with like: the single-turn and the 4-turn rollout hold the
    same number of tokens after the prompt (sampled + appended) per row."""
    from bench import bench_multiturn

    out = bench_multiturn.main(["--rows", "2", "--total", "32", "--turns", "4", "--obs", "4", "--reps", "1"])
    assert out["tokens"]["single"] == out["tokens"]["multi"] == 2 * 32
    assert out["median_s"]["single"] > 0 and out["median_s"]["multi"] > 0
