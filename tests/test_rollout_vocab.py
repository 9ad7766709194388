"""A model vocabulary larger than the tokenizer's (Qwen2.5: 151936 rows, 151665 tokens; the GPU
check's random-init 0.5B config) can sample ids the tokenizer has no text for: decoding the
responses drops them instead of failing the rollout."""

import torch

from core.tokenizer import load_tokenizer
from rl.rollout import decode_responses


def test_ids_past_the_tokenizer_are_dropped():
    tok = load_tokenizer(None)
    ids = tok.encode("12+3")
    row = torch.tensor([ids[:2] + [tok.vocab_size + 5] + ids[2:]])
    mask = torch.ones_like(row)
    assert decode_responses(tok, row, mask) == [tok.decode(ids)]
