"""The rollout's generation: never sampling ids the tokenizer cannot decode (embedding padded past
the tokenizer), stopping on any of several EOS ids and on stop strings, and the tokens/s stats."""

from dataclasses import dataclass, field

import torch

from core.config import ModelConfig
from core.model import build_model
from core.tokenizer import load_tokenizer
from rl.config import RolloutConfig
from rl.experience.rollout import collect_rollout
from rl.experience.tasks import make_task

MODEL = dict(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
             max_seq_len=64)


class SmallVocabTokenizer:
    """The tiny tokenizer seen through a vocabulary of `n` ids (a checkpoint whose embedding has
    more rows than its tokenizer), with a second EOS id."""

    def __init__(self, n: int, extra_eos: int):
        self._tok, self.vocab_size, self.extra_eos = load_tokenizer(None), n, extra_eos
        self.bos_id, self.eos_id, self.pad_id = self._tok.bos_id, self._tok.eos_id, self._tok.pad_id
        self.eos_ids = [self.eos_id, extra_eos]

    def encode(self, text):
        return self._tok.encode(text)

    def decode(self, ids):
        bad = [i for i in ids if i >= self.vocab_size]
        if bad:
            raise ValueError(f"decode: id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode([i for i in ids if i != self.extra_eos])


@dataclass
class StopConfig(RolloutConfig):
    top_p: float = 1.0
    min_p: float = 0.0
    stop: list = field(default_factory=list)


def _policy():
    policy = build_model(ModelConfig(**MODEL), seed=5)
    with torch.no_grad():
        policy.lm_head.weight[200:] *= 40  # the rows past the tokenizer would dominate the samples
    return policy


def test_rollout_never_samples_past_the_tokenizer_and_stops_on_any_eos():
    tok = SmallVocabTokenizer(200, extra_eos=57)
    cfg = StopConfig(prompts_per_step=4, group_size=4, max_new_tokens=12)
    stats = {}
    ro = collect_rollout(_policy(), tok, make_task("arithmetic", max_operand=9), lambda m, r: 0.0, cfg, seed=3,
                         step=0, stats=stats)
    resp = ro.responses_ids
    assert resp[ro.response_mask].max() < 200
    for r, m in zip(resp.tolist(), ro.response_mask.tolist()):
        n = sum(m)
        stops = [t in tok.eos_ids for t in r[:n]]
        assert not any(stops[:-1])  # no EOS before the end of a response...
        assert stops[-1] or n == 12  # ...which ends on one of the EOS ids or at max_new_tokens
    assert stats["rollout_tokens"] == int(ro.response_mask.sum())
    assert stats["rollout_tokens_per_s"] > 0 and stats["rollout_s"] > 0


def test_rollout_stops_on_stop_strings():
    tok = SmallVocabTokenizer(256, extra_eos=57)
    kw = dict(seed=3, step=1)
    task, policy = make_task("arithmetic", max_operand=9), build_model(ModelConfig(**MODEL), seed=5)
    free = collect_rollout(policy, tok, task, lambda m, r: 0.0,
                           StopConfig(prompts_per_step=4, group_size=4, max_new_tokens=12), **kw)
    text = next(t for t in free.responses if len(t.strip()) >= 3).strip()
    stop = text[len(text) // 2]  # a character some response reaches in its middle
    cut = collect_rollout(policy, tok, task, lambda m, r: 0.0,
                          StopConfig(prompts_per_step=4, group_size=4, max_new_tokens=12, stop=[stop]), **kw)
    n_cut = 0
    for r, m, got in zip(free.responses_ids.tolist(), free.response_mask.tolist(), cut.response_mask.tolist()):
        r = r[:sum(m)]
        n = next((t + 1 for t in range(len(r)) if stop in tok.decode(r[:t + 1])), len(r))  # hand-written stop
        assert sum(got) == n
        n_cut += n < len(r)
    assert n_cut > 0  # some responses were cut by the stop string
    assert torch.equal(cut.responses_ids[cut.response_mask], free.responses_ids[cut.response_mask])


def test_left_pad_matches_a_per_row_loop():
    """left_pad against the definition written out row by row: ids right-aligned over pad_id, mask 1
    exactly on the real tokens."""
    import random

    from rl.experience.rollout import left_pad
    rng = random.Random(0)
    for _ in range(50):
        rows = [[rng.randrange(100) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 7))]
        P = max(len(r) for r in rows)
        want_ids = torch.full((len(rows), P), 3, dtype=torch.long)
        want_mask = torch.zeros((len(rows), P), dtype=torch.long)
        for i, r in enumerate(rows):
            want_ids[i, P - len(r):] = torch.tensor(r)
            want_mask[i, P - len(r):] = 1
        ids, mask = left_pad(rows, 3)
        assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)
        assert ids.dtype == mask.dtype == torch.long
