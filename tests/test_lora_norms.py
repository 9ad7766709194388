"""`lora.train_norms`: a trainable delta d on every RMSNorm weight beside the LoRA adapters. The norm
scales by w + d (checked against a plain model whose norm weights are w + d), the adapters-off
reference is bitwise the base, a merge keeps the function, a LoRA step at tp=2 (and tp=2 x dp=2
under FSDP) equals the single process in float64, and d survives checkpoints, the merged export
and a PEFT modules_to_save round trip (loaded by `peft` itself)."""

import copy

import pytest
import torch

from core.config import ModelConfig, load_config
from core.lora import init_adapters, load_adapter_factors
from core.model import build_model
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from parallel.lora import LoRAConfig, adapters, adapters_disabled, apply_lora, merge_adapters, norm_deltas
from rl.config import RLConfig
from tests.test_rl_train_cli import sft_dir  # noqa: F401 (a fixture)
from tests.test_rl_trainer import BASE, GRPO, MODEL

CFG = LoRAConfig(rank=4, alpha=8, train_norms=True)
IDS = torch.arange(3, 3 + 2 * 12).view(2, 12) % 250 + 3
NORMS = 2 * MODEL["n_layers"] + 1


def _randomize_deltas(model, seed=5, std=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for nd in norm_deltas(model).values():
            nd.lora_d.copy_(torch.randn(nd.lora_d.shape, generator=g, dtype=torch.float64) * std)


def _adapted(dtype=torch.float32, cfg=CFG, mc=None):
    mc = mc or ModelConfig(**MODEL)
    model = build_model(mc, seed=11, dtype=dtype)
    init_adapters(apply_lora(model, cfg), seed=3, b_std=0.05)
    _randomize_deltas(model)
    return mc, model


def test_norm_deltas_are_trainable_fp32_zeros_and_counted_by_the_budget():
    from core.runtime.budget import lora_params

    mc = ModelConfig(**MODEL)
    model = build_model(mc, seed=11)
    init_adapters(apply_lora(model, CFG), seed=3)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    deltas = {n for n in trainable if n.endswith(".lora.lora_d")}
    assert deltas == {f"layers.{i}.{k}.lora.lora_d" for i in range(MODEL["n_layers"]) for k in ("attn_norm", "mlp_norm")
                      } | {"norm.lora.lora_d"}
    assert len(trainable) == 2 * 7 * MODEL["n_layers"] + NORMS
    assert all(trainable[n].dtype == torch.float32 and not trainable[n].any() for n in deltas)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora" not in n)
    n = sum(p.numel() for p in trainable.values())
    assert lora_params(mc, 1, 4, CFG.targets, norms=True) == n
    assert lora_params(mc, 1, 4, CFG.targets) == n - NORMS * MODEL["hidden_size"]


def test_adapters_off_is_the_base_model_bitwise():
    mc, model = _adapted()
    base = build_model(mc, seed=11)
    with torch.no_grad():
        with adapters_disabled(model):
            off = model(IDS)
        on = model(IDS)
        want = base(IDS)
    assert torch.equal(off, want)
    assert all(nd.lora_d.abs().max() > 0.1 for nd in norm_deltas(model).values())
    # the deltas alone change the model: the adapters off, only d on
    with torch.no_grad():
        for ad in adapters(model).values():
            ad.enabled = False
        only_d = model(IDS)
    assert (only_d - want).abs().max() > 1e-2 and (on - only_d).abs().max() > 1e-3


def test_forward_is_the_plain_model_with_norm_weights_w_plus_d():
    mc, model = _adapted(dtype=torch.float64)
    plain = build_model(mc, seed=11, dtype=torch.float64)
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, ad in adapters(model).items():
            params[name] += (8 / 4) * ad.lora_B @ ad.lora_A
        for name, nd in norm_deltas(model).items():
            params[name] += nd.lora_d
        torch.testing.assert_close(model(IDS), plain(IDS), atol=1e-12, rtol=0)


def test_merge_keeps_the_function_and_zeroes_d():
    _, model = _adapted()
    merged = copy.deepcopy(model)
    merge_adapters(merged, reset=True)
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS), model(IDS), atol=1e-5, rtol=1e-5)
        with adapters_disabled(merged):  # the hard-synced reference is the old adapted policy, norms included
            torch.testing.assert_close(merged(IDS), model(IDS), atol=1e-5, rtol=1e-5)
    assert all(float(nd.lora_d.detach().abs().max()) == 0.0 for nd in norm_deltas(merged).values())


def test_train_norms_without_lora_is_refused():
    with pytest.raises(Exception, match="lora.train_norms=true .* lora.rank > 0"):
        load_config(RLConfig, None, BASE + ["lora.train_norms=true"])




def test_gradient_of_d_is_the_gradient_of_the_norm_weight():
    # independent: the same loss through a plain (unadapted) model whose norm weights are w + d
    mc, model = _adapted(dtype=torch.float64)
    plain = build_model(mc, seed=11, dtype=torch.float64)
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, ad in adapters(model).items():
            params[name] += (8 / 4) * ad.lora_B @ ad.lora_A
        for name, nd in norm_deltas(model).items():
            params[name] += nd.lora_d
    model(IDS).pow(2).mean().backward()
    plain(IDS).pow(2).mean().backward()
    for name, nd in norm_deltas(model).items():
        torch.testing.assert_close(nd.lora_d.grad, params[name].grad, atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------------------------------------
# a GRPO step at tp=2 (and tp=2 x dp=2, FSDP) equals the single process in float64


def _steps(tp, dp, sp=False):
    from core.tokenizer import load_tokenizer
    from parallel.comm import gather_from_tp
    from rl.train import assemble

    torch.set_num_threads(1)
    cfg = load_config(RLConfig, None, BASE + GRPO + ["lora.rank=4", "lora.alpha=8", "lora.train_norms=true",
                                                     f"parallel.sequence_parallel={str(sp).lower()}"])
    mc = ModelConfig(**MODEL)
    state = init_parallel(ParallelDims(dp, tp), "cpu", mc.n_heads, mc.n_kv_heads)
    policy = build_model(mc, state.tp_group, kv_replica_group(state, mc.n_kv_heads), seed=11, dtype=torch.float64)
    init_adapters(apply_lora(policy, cfg.lora), seed=3, b_std=0.05)
    trainer = assemble(cfg, state, mc, load_tokenizer(None), policy, None)
    recs = [trainer.step(s) for s in range(2)]
    with torch.no_grad():
        on = gather_from_tp(trainer.policy(IDS), state.tp_group)[..., :256]
        merge_adapters(trainer.policy)
        with adapters_disabled(trainer.policy):
            merged = gather_from_tp(trainer.policy(IDS), state.tp_group)[..., :256]
    keys = ("reward_mean", "kl_mean", "pg_loss", "grad_norm", "entropy", "kl_loss")
    return [{k: r[k] for k in keys} for r in recs], on, merged


@pytest.fixture(scope="module")
def single():
    return _steps(1, 1)


def _same(want, got):
    for a, b in zip(want[0], got[0]):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-10, abs=1e-12), k
    torch.testing.assert_close(got[1], want[1], atol=1e-10, rtol=0)
    torch.testing.assert_close(got[2], want[2], atol=1e-10, rtol=0)


@pytest.mark.slow
def test_step_moves_d_and_merge_keeps_the_policy(single):
    recs, on, merged = single
    assert recs[1]["kl_mean"] > 0.0 and recs[0]["grad_norm"] > 0.0
    torch.testing.assert_close(merged, on, atol=1e-10, rtol=0)


@pytest.mark.slow
def test_tp2_matches_single_process(dist_pools, single):
    for r in dist_pools.run(2, _steps, 2, 1):
        _same(single, r)


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_single_process(dist_pools, single):
    """Under Megatron SP each TP rank's norm sees its sequence shard only: d's gradient is summed over tp
    with the norm weight's (core/model.py RMSNorm), and the step equals the single process."""
    for r in dist_pools.run(2, _steps, 2, 1, True):
        _same(single, r)


@pytest.mark.slow
def test_tp2_dp2_fsdp_matches_single_process(dist_pools, single):
    for r in dist_pools.run(4, _steps, 2, 2):
        _same(single, r)


@pytest.mark.slow
def test_steps_train_d_and_leave_the_base():
    from core.tokenizer import load_tokenizer
    from rl.train import assemble

    torch.set_num_threads(1)
    cfg = load_config(RLConfig, None, BASE + GRPO + ["lora.rank=4", "lora.alpha=8", "lora.train_norms=true"])
    mc = ModelConfig(**MODEL)
    state = init_parallel(ParallelDims(1, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    policy = build_model(mc, seed=11)
    init_adapters(apply_lora(policy, cfg.lora), seed=3, b_std=0.05)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainer = assemble(cfg, state, mc, load_tokenizer(None), policy, None)
    trainer.step(0)
    after = dict(trainer.policy.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert {n for n in moved if n.endswith("lora_d")} == {n for n in before if n.endswith("lora_d")}
    assert all("lora" in n for n in moved)  # the base norms (the reference) stay
    assert any(n.endswith(".lora_d") for n, _ in trainer.opt.named)  # d has AdamW state


# ---------------------------------------------------------------------------------------------
# checkpoints and exports


def test_adapter_checkpoint_round_trips_d_and_its_optimizer_state(tmp_path):
    from safetensors import safe_open

    from core.ckpt import load_train_checkpoint, save_train_checkpoint
    from core.ckpt.adapters import AdapterView
    from core.config import OptimConfig
    from core.optim import build_optimizer

    mc, model = _adapted()
    opt = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0), mc, 10)
    model(IDS).float().pow(2).mean().backward()
    opt.step()
    path = save_train_checkpoint(str(tmp_path / "ck"), 0, None, {"adapters": (AdapterView(model), opt)})
    fresh = build_model(mc, seed=11)
    init_adapters(apply_lora(fresh, CFG), seed=3)
    opt2 = build_optimizer(fresh, OptimConfig(lr=1e-2, warmup_steps=0), mc, 10)
    load_train_checkpoint(path, None, {"adapters": (AdapterView(fresh), opt2)})
    with torch.no_grad():
        assert torch.equal(fresh(IDS), model(IDS))
    with safe_open(f"{path}/adapters.safetensors", "pt") as f:
        keys = set(f.keys())
    assert keys == {n for n, p in model.named_parameters() if p.requires_grad}
    assert sum(k.endswith(".lora.lora_d") for k in keys) == NORMS
    # one more identical step from each: the optimizer state of d came back too
    for m, o in ((model, opt), (fresh, opt2)):
        o.zero_grad()
        m(IDS).float().pow(2).mean().backward()
        o.step()
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from core.ckpt import save_model_weights
    from core.ckpt.adapters import write_lora_config

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("norms")
    mc, model = _adapted()
    save_model_weights(build_model(mc, seed=11), str(tmp / "base"), None)
    save_model_weights(model, str(tmp / "adapted"), None, extra_files=[write_lora_config(str(tmp), CFG)])
    with torch.no_grad():
        want = model(IDS)[..., :256]
    return tmp, model, want


def test_model_folder_loads_back_with_its_norm_deltas(saved):
    from core.ckpt import load_model_weights
    from core.ckpt.adapters import adapt_to_checkpoint

    tmp, _, want = saved
    model = adapt_to_checkpoint(build_model(ModelConfig(**MODEL), seed=5), str(tmp / "adapted"))
    load_model_weights(model, str(tmp / "adapted"), None)
    assert len(norm_deltas(model)) == NORMS
    with torch.no_grad():
        assert torch.equal(model(IDS)[..., :256], want)


def test_merged_export_gives_the_adapted_logits(saved, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tools.convert_hf import export_hf

    tmp, _, want = saved
    export_hf(str(tmp / "adapted"), str(tmp_path / "merged"), merge_lora=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def peft_folder(saved, tmp_path_factory):
    from tools.convert_hf import export_hf

    tmp, _, _ = saved
    out = tmp_path_factory.mktemp("peft") / "p"
    export_hf(str(tmp / "adapted"), str(out), peft=True)
    return str(out)


def test_peft_loads_the_adapter_and_the_norms_on_the_exported_base(saved, peft_folder, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tools.convert_hf import export_hf

    tmp, _, want = saved
    export_hf(str(tmp / "base"), str(tmp_path / "base_hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base_hf")).eval()
    pm = peft.PeftModel.from_pretrained(hf, peft_folder).eval()
    assert sorted(pm.peft_config["default"].modules_to_save) == ["input_layernorm", "norm", "post_attention_layernorm"]
    with torch.no_grad():
        got = pm(IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad(), pm.disable_adapter():  # PEFT's adapters-off is the base: its norms untouched
        torch.testing.assert_close(pm(IDS).logits, build_model(ModelConfig(**MODEL), seed=11)(IDS)[..., :256],
                                   atol=1e-5, rtol=1e-5)


def test_peft_folder_reads_back_to_d(saved, peft_folder):
    from core.ckpt.adapters import peft_factors

    _, model, want = saved
    mc = ModelConfig(**MODEL)
    fresh = build_model(mc, seed=11)
    cfg = LoRAConfig(rank=4, alpha=8, train_norms=True, init_from=peft_folder)
    init_adapters(apply_lora(fresh, cfg), seed=99)  # overwritten by the folder
    load_adapter_factors(fresh, peft_factors(cfg), "test")
    for name, nd in norm_deltas(model).items():  # d = (w + d) - w in fp32
        torch.testing.assert_close(norm_deltas(fresh)[name].lora_d, nd.lora_d, atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(fresh(IDS)[..., :256], want, atol=1e-5, rtol=1e-5)


def test_peft_norms_into_a_run_without_train_norms_is_refused(peft_folder):
    from core.ckpt import CheckpointError
    from core.ckpt.adapters import peft_factors

    with pytest.raises(CheckpointError, match="lora.train_norms=true"):
        peft_factors(LoRAConfig(rank=4, alpha=8, init_from=peft_folder))


@pytest.mark.slow
def test_rl_train_resume_restores_d(sft_dir):  # noqa: F811
    """`rl.train` with train_norms: the adapter checkpoint holds d, and a resumed run equals an
    uninterrupted one."""
    import os

    from rl.train import main
    from tests.test_lora_train import DENSE, LORA
    from tests.test_rl_train_cli import CONFIG, KEYS, SMALL, _rows

    base, sft = sft_dir
    flags = [*SMALL, *LORA, *DENSE, "lora.train_norms=true", f"init.sft_dir={sft}"]
    straight_out, out = str(base / "norms_straight"), str(base / "norms_resumed")
    assert main(["--config", CONFIG, *flags, f"train.out_dir={straight_out}"]) == 0
    common = ["--config", CONFIG, *flags, f"train.out_dir={out}"]
    assert main([*common, "train.stop_after=2"]) == 0
    from safetensors import safe_open

    with safe_open(os.path.join(out, "checkpoints", "step-00000001", "adapters.safetensors"), "pt") as f:
        d = [f.get_tensor(k) for k in f.keys() if k.endswith(".lora.lora_d")]
    assert len(d) == NORMS and all(t.abs().max() > 0 for t in d)  # trained, saved
    assert main(common) == 0
    straight, resumed = _rows(straight_out), _rows(out)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(straight, resumed):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}


@pytest.mark.slow
def test_a_folder_saved_by_peft_reads_into_the_same_model(saved, tmp_path):
    """Independent of kltron's writer: PEFT itself saves LoRA + modules_to_save norms (trained in PEFT's
    model), and the run that reads it (lora.init_from) computes PEFT's logits."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from core.ckpt.adapters import peft_factors
    from tools.convert_hf import export_hf

    tmp, _, _ = saved
    export_hf(str(tmp / "base"), str(tmp_path / "base_hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base_hf")).eval()
    pc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"],
                         modules_to_save=["input_layernorm", "post_attention_layernorm", "norm"])
    pm = peft.get_peft_model(hf, pc)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:  # B (zeros in PEFT) and the norm copies: move everything off its init
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pm.eval()
    with torch.no_grad():
        want = pm(IDS).logits
    pm.save_pretrained(str(tmp_path / "peft_saved"))
    mc = ModelConfig(**MODEL)
    model = build_model(mc, seed=11)
    cfg = LoRAConfig(rank=4, alpha=8, train_norms=True, init_from=str(tmp_path / "peft_saved"))
    init_adapters(apply_lora(model, cfg), seed=99)
    load_adapter_factors(model, peft_factors(cfg), "test")
    assert all(nd.lora_d.abs().max() > 0.01 for nd in norm_deltas(model).values())
    with torch.no_grad():
        torch.testing.assert_close(model(IDS)[..., :256], want, atol=1e-5, rtol=1e-5)
