"""A model vocabulary larger than the tokenizer's (Qwen2.5: 151936 rows, 151665 tokens; the GPU
check's random-init 0.5B config) can sample ids the tokenizer has no text for: decoding the
responses drops them instead of failing the rollout."""

import pytest
import torch

from core.tokenizer import load_tokenizer
from rl.experience.rollout import decode_responses


def test_ids_past_the_tokenizer_are_dropped():
    tok = load_tokenizer(None)
    ids = tok.encode("12+3")
    row = torch.tensor([ids[:2] + [tok.vocab_size + 5] + ids[2:]])
    mask = torch.ones_like(row)
    assert decode_responses(tok, row, mask) == [tok.decode(ids)]


def test_batch_decode_matches_per_row_decode():
    """decode_responses' one decode_batch call gives each row's own decode (sentencepiece backend),
    with masked positions and EOS dropped; an out-of-vocabulary id in decode_batch is refused."""
    tok = load_tokenizer(None)
    texts = ["12+3", "7*8=56", "", "hello world"]
    rows = [tok.encode(t) for t in texts]
    width = max(len(r) for r in rows) + 1
    seq = torch.full((len(rows), width), tok.eos_id)
    mask = torch.zeros_like(seq)
    for i, r in enumerate(rows):
        seq[i, :len(r)], mask[i, :len(r) + 1] = torch.tensor(r, dtype=torch.long), 1  # + the EOS
    assert decode_responses(tok, seq, mask) == [tok.decode(r) for r in rows]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode_batch([[3], [tok.vocab_size]])


def test_task_prompts_cache_gives_the_tokenizers_ids(monkeypatch):
    """TaskPrompts keeps each prompt text's ids: repeated texts, a batch with duplicates and a batch after the
    cache starts over all get bos + the tokenizer's own encoding, and the backend sees each text once."""
    from rl.experience.rollout import TaskPrompts
    tok, plain = load_tokenizer(None), load_tokenizer(None)
    seen = []
    real = tok.encode_batch
    monkeypatch.setattr(tok, "encode_batch", lambda texts, **kw: seen.extend(texts) or real(texts, **kw))
    tp = TaskPrompts(None, tok)
    tp.CACHE = 4
    want = lambda ts: [[plain.bos_id] + plain.encode(t) for t in ts]
    for batch in (["1+2=", "3+4=", "1+2="], ["3+4=", "5+6="], ["7+8=", "9+1=", "1+2="], ["1+2="]):
        got = tp._encode(batch)
        assert got == want(batch)
        got[0].append(-1)  # the caller's list, not the cache's
    assert tp._encode(["1+2="]) == want(["1+2="])
    assert seen == ["1+2=", "3+4=", "5+6=", "7+8=", "9+1=", "1+2="]  # 3rd batch: over 4 texts, starts over
