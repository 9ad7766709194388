"""A LoRA model out of kltron: merged weights and a PEFT adapter folder give the adapted model's
logits in `transformers` (and `peft`, when installed); a PEFT folder reads back to the same factors."""

import pytest
import torch

from core.ckpt import CheckpointError, save_model_weights
from core.ckpt.adapters import read_peft, write_lora_config
from core.config import ModelConfig
from core.lora import init_adapters
from core.model import build_model
from parallel.lora import LoRAConfig, adapters, apply_lora
from tools.convert_hf import export_hf

transformers = pytest.importorskip("transformers")

MODEL = dict(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
             max_seq_len=64, bos_id=1, eos_id=2, pad_id=0)
LORA = LoRAConfig(rank=4, alpha=8, targets=["q", "k", "v", "o", "gate", "up", "down"])
IDS = torch.arange(3, 3 + 2 * 12).view(2, 12) % 250 + 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("lora")
    mc = ModelConfig(**MODEL)
    base = build_model(mc, seed=11)
    save_model_weights(base, str(tmp / "base"), None)
    model = build_model(mc, seed=11)
    init_adapters(apply_lora(model, LORA), seed=3, b_std=0.05)
    save_model_weights(model, str(tmp / "adapted"), None, extra_files=[write_lora_config(str(tmp), LORA)])
    with torch.no_grad():
        want = model(IDS)[..., :256]
    return tmp, model, want


def test_plain_export_of_a_lora_checkpoint_is_refused(saved, tmp_path):
    tmp, _, _ = saved
    with pytest.raises(CheckpointError, match="--merge-lora"):
        export_hf(str(tmp / "adapted"), str(tmp_path / "x"))


def test_merged_export_gives_the_adapted_logits(saved, tmp_path):
    tmp, _, want = saved
    export_hf(str(tmp / "adapted"), str(tmp_path / "merged"), merge_lora=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, want, atol=1e-5, rtol=1e-5)


def test_peft_folder_reads_back_to_the_same_factors(saved, tmp_path):
    tmp, model, _ = saved
    export_hf(str(tmp / "adapted"), str(tmp_path / "peft"), peft=True)
    lora, factors = read_peft(str(tmp_path / "peft"))
    assert (lora.rank, lora.alpha, sorted(lora.targets)) == (4, 8.0, sorted(LORA.targets))
    for name, ad in adapters(model).items():
        stem = name[:-len(".weight")]
        assert torch.equal(factors[f"{stem}.lora.lora_A"], ad.lora_A.detach())
        assert torch.equal(factors[f"{stem}.lora.lora_B"], ad.lora_B.detach())


def test_peft_loads_the_adapter_on_the_exported_base(saved, tmp_path):
    peft = pytest.importorskip("peft")
    tmp, _, want = saved
    export_hf(str(tmp / "base"), str(tmp_path / "base_hf"))
    export_hf(str(tmp / "adapted"), str(tmp_path / "peft"), peft=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base_hf")).eval()
    with torch.no_grad():
        base_logits = hf(IDS).logits
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        got = pm(IDS).logits
    assert (got - base_logits).abs().max() > 1e-3  # the adapter was applied
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _from_peft_tp2(folder):
    from core.ckpt.adapters import peft_factors
    from core.lora import load_adapter_factors
    from parallel.comm import gather_from_tp
    from parallel.dims import ParallelDims, init_parallel, kv_replica_group

    state = init_parallel(ParallelDims(1, 2), "cpu", MODEL["n_heads"], MODEL["n_kv_heads"])
    mc = ModelConfig(**MODEL)
    model = build_model(mc, state.tp_group, kv_replica_group(state, mc.n_kv_heads), seed=11)
    cfg = LoRAConfig(rank=4, alpha=8, init_from=folder)
    init_adapters(apply_lora(model, cfg), seed=99)  # overwritten by the folder's factors
    load_adapter_factors(model, peft_factors(cfg), "test")
    with torch.no_grad():
        return gather_from_tp(model(IDS), state.tp_group)[..., :256]


@pytest.mark.slow
def test_peft_folder_continues_training_at_tp2(saved, tmp_path, dist_pools):
    tmp, _, want = saved
    folder = str(tmp_path / "peft")
    export_hf(str(tmp / "adapted"), folder, peft=True)
    for got in dist_pools.run(2, _from_peft_tp2, folder):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_peft_folder_with_another_rank_is_refused(saved, tmp_path):
    from core.ckpt.adapters import peft_factors

    tmp, _, _ = saved
    export_hf(str(tmp / "adapted"), str(tmp_path / "peft"), peft=True)
    with pytest.raises(CheckpointError, match="lora.rank"):
        peft_factors(LoRAConfig(rank=8, alpha=8, init_from=str(tmp_path / "peft")))


def test_tools_load_a_lora_model_folder_as_the_adapted_model(saved):
    from core.ckpt import load_model_weights
    from core.ckpt.adapters import adapt_to_checkpoint

    tmp, _, want = saved
    got = adapt_to_checkpoint(build_model(ModelConfig(**MODEL), seed=5), str(tmp / "adapted"))
    load_model_weights(got, str(tmp / "adapted"), None)
    plain = adapt_to_checkpoint(build_model(ModelConfig(**MODEL), seed=5), str(tmp / "base"))
    assert not adapters(plain)  # a checkpoint without adapters leaves the model plain
    with torch.no_grad():
        assert torch.equal(got(IDS)[..., :256], want)
