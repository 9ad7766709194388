"""Multi-turn rollouts (rl/experience/episodes.py, core/generation/multiturn.py): the ids trained on
are exactly the ids sampled plus the ids appended; the KV-cache continuation scores what a fresh
forward of the whole episode scores; appended (observation) tokens reach no gradient."""

from __future__ import annotations

import pytest
import torch

from core.config import ModelConfig, load_config
from core.generation import multiturn as mt
from core.generation.generate import _Stopper
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
        done = self.turn >= self.done_at or (len(ids) % 3 == 0 and self.turn > 0)
        self.turn += 1
        return Turn(obs, float(len(ids) % 2), done=done)


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
        for k, (turn, ids, obs) in enumerate(steps):
            want += ids
            want_mask += [True] * len(ids)
            if k < len(steps) - 1:  # an observation is appended only when another turn follows
                app = tok.encode(render_observation(tok, obs, bool(ids) and ids[-1] in eos))
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
