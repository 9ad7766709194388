"""Paths that run without reading values, run with inputs on `meta`: any tensor the code makes on
the CPU meets a meta tensor in some op and raises, as a CPU tensor would meet a CUDA one. (The
fused heads' meta test is in tests/test_vocab_numerics.py; paths that validate values with
.item(), like the losses' checks and the sampler, cannot run on meta and are covered by the
source walk of tests/test_device_discipline.py.)"""

from __future__ import annotations

import pytest
import torch

from core.config import ModelConfig
from core.model import build_model
from rl.objectives.advantages import gae
from rl.objectives.kl import ESTIMATORS, KLConfig, kl_from_config, masked_mean, masked_sum

MC = ModelConfig(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                 max_seq_len=64)
META = torch.device("meta")


def test_mixed_devices_do_raise_on_meta():
    """The premise: a CPU model fed meta inputs fails (so a stray CPU tensor would too)."""
    model = build_model(MC, seed=0)
    with pytest.raises(RuntimeError, match="meta"):
        model(torch.zeros(2, 8, dtype=torch.long, device=META))


@pytest.mark.parametrize("with_mask", [False, True])
def test_model_forward_on_meta(with_mask):
    model = build_model(MC, seed=None, device=META)
    ids = torch.zeros(2, 8, dtype=torch.long, device=META)
    kw = {"attention_mask": torch.ones(2, 8, dtype=torch.long, device=META)} if with_mask else {}
    out = model(ids, **kw)
    assert out.device == META and out.shape == (2, 8, model.padded_vocab)
    out.float().sum().backward()  # backward too: the autograd collectives and the embedding
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_kl_estimators_and_aggregation_on_meta(estimator):
    lp, ref = torch.zeros(4, 6, device=META), torch.zeros(4, 6, device=META)
    mask = torch.ones(4, 6, dtype=torch.bool, device=META)
    kl = kl_from_config(KLConfig(estimator=estimator), lp, ref)
    assert kl.device == META
    assert masked_mean(kl, mask).device == META and masked_sum(kl, mask, dim=1).device == META


def test_gae_on_meta():
    r = torch.zeros(4, 6, device=META)
    adv, ret = gae(r, r, torch.ones(4, 6, device=META), 1.0, 0.95)
    assert adv.device == META and ret.device == META
