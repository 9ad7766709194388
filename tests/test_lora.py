"""LoRA on the TP layers: the adapters-off reference is bitwise the base model, a merged model
computes the adapted one, and a LoRA GRPO step does not depend on the tp x dp layout."""

import copy

import pytest
import torch

from core.config import ModelConfig, load_config
from core.lora import init_adapters
from core.model import build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from parallel.lora import LoRAConfig, adapters, adapters_disabled, apply_lora, merge_adapters
from rl.config import RLConfig
from rl.models.lora_ref import BaseReference
from tests.test_rl_trainer import BASE, GRPO, MODEL, PPO

LORA = ["lora.rank=4", "lora.alpha=8"]
IDS = torch.arange(3, 3 + 2 * 12).view(2, 12) % 250 + 3


def _adapted(dtype=torch.float32, b_std=0.05, **kw):
    mc = ModelConfig(**MODEL)
    model = build_model(mc, seed=11, dtype=dtype)
    init_adapters(apply_lora(model, LoRAConfig(rank=4, alpha=8, **kw)), seed=3, b_std=b_std)
    return mc, model


def test_base_frozen_and_adapters_trainable():
    _, model = _adapted()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora.lora_" in n for n in trainable)
    assert len(trainable) == 2 * 7 * MODEL["n_layers"]  # A and B on q k v o gate up down of each layer
    assert all(a.lora_A.dtype == torch.float32 for a in adapters(model).values())


def test_adapters_off_is_the_base_model_bitwise():
    mc, model = _adapted()
    base = build_model(mc, seed=11)
    with torch.no_grad():
        with adapters_disabled(model):
            off = model(IDS)
        on = model(IDS)
        want = base(IDS)
    assert torch.equal(off, want)
    assert (on - want).abs().max() > 1e-3  # the adapters do change the model


def test_lora_forward_is_w_plus_scaled_ba():
    # an independent formula: every adapted weight replaced by W + (alpha / r) B A in a plain model
    mc, model = _adapted(dtype=torch.float64)
    plain = build_model(mc, seed=11, dtype=torch.float64)
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, ad in adapters(model).items():
            params[name] += (8 / 4) * ad.lora_B @ ad.lora_A
        torch.testing.assert_close(model(IDS), plain(IDS), atol=1e-12, rtol=0)


def test_rslora_scaling():
    assert LoRAConfig(rank=16, alpha=8, rslora=True).scaling == 2.0
    assert LoRAConfig(rank=16, alpha=8).scaling == 0.5


def test_merge_then_reset_keeps_the_function():
    _, model = _adapted()
    merged = copy.deepcopy(model)
    merge_adapters(merged, reset=True)
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS), model(IDS), atol=1e-5, rtol=1e-5)
        with adapters_disabled(merged):  # the new reference is the old adapted policy
            torch.testing.assert_close(merged(IDS), model(IDS), atol=1e-5, rtol=1e-5)
    assert all(float(a.lora_B.detach().abs().max()) == 0.0 for a in adapters(merged).values())


@pytest.mark.parametrize("bad, msg", [
    (["lora.targets=[q,foo]"], "lora.targets"),
    (["reference.from_policy_base=true"], "lora.rank > 0"),
    (LORA + ["reference.sync_every=2", "reference.sync_mode=ema"], "sync_mode=ema"),
    (LORA + ["reference.cpu_offload=true"], "reference.cpu_offload"),
])
def test_bad_lora_config_names_the_key(bad, msg):
    with pytest.raises(Exception, match=msg):
        load_config(RLConfig, None, BASE + list(bad))


def _lora_trainer(tp, dp, overrides, dtype):
    from rl.train import assemble

    cfg = load_config(RLConfig, None, BASE + LORA + list(overrides))
    mc = ModelConfig(**MODEL)
    state = init_parallel(ParallelDims(dp, tp), "cpu", mc.n_heads, mc.n_kv_heads)
    kv = kv_replica_group(state, mc.n_kv_heads)
    policy = build_model(mc, state.tp_group, kv, seed=11, dtype=dtype)
    # B != 0 from the start, so that the first step moves A as well as B (B = 0 gives dL/dA = 0)
    init_adapters(apply_lora(policy, cfg.lora), seed=3, b_std=0.05)
    critic = None
    if cfg.algo.name == "ppo":  # PPO's value model: a full model of its own, trained in full (no adapters)
        from rl.models.critic import Critic

        critic = Critic(mc, state.tp_group, kv, dtype=dtype)
        critic.body.init_weights(11)
    return assemble(cfg, state, mc, load_tokenizer(None), policy, None, critic), state


def _lora_steps(tp, dp, overrides):
    from parallel.comm import gather_from_tp

    trainer, state = _lora_trainer(tp, dp, overrides, torch.float64)
    recs = [trainer.step(s) for s in range(2)]
    with torch.no_grad():
        logits = gather_from_tp(trainer.policy(IDS), state.tp_group)[..., :256]
    keys = ("reward_mean", "kl_mean", "pg_loss", "grad_norm", "entropy", "ratio_mean", "kl_loss")
    return [{k: r[k] for k in keys} for r in recs], logits


@pytest.fixture(scope="module")
def lora_single():
    torch.set_num_threads(1)
    return _lora_steps(1, 1, GRPO)


def _same(single, got):
    for a, b in zip(single[0], got[0]):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-10, abs=1e-12), k
    torch.testing.assert_close(got[1], single[1], atol=1e-10, rtol=0)


def test_lora_step_kl_is_against_the_base(lora_single):
    recs, _ = lora_single
    # B != 0 here: the adapted policy already differs from its base (the reference) at step 0
    assert recs[0]["kl_mean"] > 0.0 and recs[0]["grad_norm"] > 0.0


@pytest.mark.slow
def test_lora_grpo_tp2_dp2_matches_single_process(dist_pools, lora_single):
    for r in dist_pools.run(4, _lora_steps, 2, 2, GRPO):
        _same(lora_single, r)


@pytest.mark.slow
def test_lora_grpo_tp2_matches_single_process(dist_pools, lora_single):
    for r in dist_pools.run(2, _lora_steps, 2, 1, GRPO):
        _same(lora_single, r)


@pytest.mark.slow
def test_lora_ppo_tp2_matches_single_process(dist_pools):
    """PPO with LoRA: the KL in the reward against the adapters-off base, GAE over a full critic; the step at
    tp=2 equals the single process (float64), and the critic trains in full beside the adapters."""
    single = _lora_steps(1, 1, PPO)
    assert single[0][0]["kl_mean"] > 0.0 and single[0][0]["grad_norm"] > 0.0
    for r in dist_pools.run(2, _lora_steps, 2, 1, PPO):
        _same(single, r)


def test_lora_ppo_trains_the_adapters_and_the_whole_critic():
    trainer, _ = _lora_trainer(1, 1, PPO, torch.float64)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    critic_before = [p.detach().clone() for p in trainer.critic.parameters()]
    trainer.step(0)
    moved = {n for n, p in trainer.policy.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora" in n for n in moved), moved
    assert all(not p.requires_grad for n, p in trainer.policy.named_parameters() if "lora" not in n)
    assert all(p.requires_grad for p in trainer.critic.parameters())
    assert sum(not torch.equal(a, b) for a, b in zip(critic_before, trainer.critic.parameters())) > 0


def _save_adapted_tp2(path):
    from core.ckpt import save_model_weights

    state = init_parallel(ParallelDims(1, 2), "cpu", MODEL["n_heads"], MODEL["n_kv_heads"])
    mc = ModelConfig(**MODEL)
    model = build_model(mc, state.tp_group, kv_replica_group(state, mc.n_kv_heads), seed=11)
    init_adapters(apply_lora(model, LoRAConfig(rank=4, alpha=8)), seed=3, b_std=0.05)
    save_model_weights(model, path, state)
    return True


@pytest.mark.slow
def test_adapters_saved_at_tp2_load_at_tp1(dist_pools, tmp_path):
    from core.ckpt import load_model_weights

    path = str(tmp_path / "m")
    assert dist_pools.run(2, _save_adapted_tp2, path) == [True, True]
    mc, want = _adapted()  # the same seeds, built and initialised in one process
    got = build_model(mc, seed=5)
    apply_lora(got, LoRAConfig(rank=4, alpha=8))
    load_model_weights(got, path, None)
    with torch.no_grad():
        assert torch.equal(got(IDS), want(IDS))


def test_budget_counts_the_adapters_only_and_no_reference():
    from core.runtime.budget import Batch, Layout, lora_params, param_counts, step_budget

    mc, model = _adapted()
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(mc, 1, 4, LoRAConfig().targets) == n
    batch = Batch(rollout_rows=8, update_rows=4, seq_len=32, response_len=16)
    full = step_budget(mc, Layout(), batch, "tp")
    lora = step_budget(mc, Layout(), batch, "policy_base", lora_rank=4)
    assert lora["parts"]["reference"] == 0 and full["parts"]["reference"] == param_counts(mc, 1)["total"] * 4
    assert lora["parts"]["gradients"] == 4 * n and lora["parts"]["AdamW state"] == 8 * n
    assert lora["parts"]["policy weights"] == full["parts"]["policy weights"] + 4 * n
    assert lora["peak"] < full["peak"]


def test_adapter_checkpoint_holds_only_the_adapters(tmp_path):
    from core.ckpt import load_train_checkpoint, save_train_checkpoint
    from core.ckpt.adapters import AdapterView
    from core.config import OptimConfig
    from core.optim import build_optimizer

    mc, model = _adapted()
    opt = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0), mc, 10)
    model(IDS).float().pow(2).mean().backward()
    opt.step()
    path = save_train_checkpoint(str(tmp_path / "ck"), 0, None, {"adapters": (AdapterView(model), opt)})
    _, fresh = _adapted(b_std=0.0)
    opt2 = build_optimizer(fresh, OptimConfig(lr=1e-2, warmup_steps=0), mc, 10)
    load_train_checkpoint(path, None, {"adapters": (AdapterView(fresh), opt2)})
    with torch.no_grad():
        assert torch.equal(fresh(IDS), model(IDS))
    from safetensors import safe_open

    with safe_open(f"{path}/adapters.safetensors", "pt") as f:
        assert set(f.keys()) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_resume_onto_another_base_is_refused(tmp_path):
    from core.ckpt import CheckpointError, save_model_weights
    from core.ckpt.adapters import base_pointer, check_base_pointer

    mc = ModelConfig(**MODEL)
    save_model_weights(build_model(mc, seed=11), str(tmp_path / "a"), None)
    save_model_weights(build_model(mc, seed=12), str(tmp_path / "b"), None)
    a, b = base_pointer(str(tmp_path / "a")), base_pointer(str(tmp_path / "b"))
    check_base_pointer(a, base_pointer(str(tmp_path / "a")), "ck")
    with pytest.raises(CheckpointError, match="manifest sha256"):
        check_base_pointer(a, b, "ck")
    with pytest.raises(CheckpointError, match="lora.rank"):
        check_base_pointer(None, b, "ck")


def test_hard_sync_merges_into_the_base():
    from rl.models.lora_ref import BaseReference
    from rl.models.reference import sync_reference

    _, model = _adapted()
    ref = BaseReference(model)
    with torch.no_grad():
        before = model(IDS)
        sync_reference(model, ref, "hard")
        torch.testing.assert_close(ref(IDS), before, atol=1e-5, rtol=1e-5)  # the new reference: the old policy
        torch.testing.assert_close(model(IDS), before, atol=1e-5, rtol=1e-5)
    assert not list(ref.parameters())  # it owns no weights


def _merged_logits(tp, dp):
    from parallel.comm import gather_from_tp
    from parallel.fsdp import FSDPOptions, parallelize

    state = init_parallel(ParallelDims(dp, tp), "cpu", MODEL["n_heads"], MODEL["n_kv_heads"])
    mc = ModelConfig(**MODEL)
    model = build_model(mc, state.tp_group, kv_replica_group(state, mc.n_kv_heads), seed=11, dtype=torch.float64)
    init_adapters(apply_lora(model, LoRAConfig(rank=4, alpha=8)), seed=3, b_std=0.05)
    model = parallelize(model, state.dp_mesh, FSDPOptions())
    merge_adapters(model)
    with torch.no_grad(), adapters_disabled(model):
        return gather_from_tp(model(IDS), state.tp_group)[..., :256]


@pytest.mark.slow
def test_merge_under_tp2_fsdp2_matches_single_process(dist_pools):
    want = _merged_logits(1, 1)
    for got in dist_pools.run(4, _merged_logits, 2, 2):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def _collectives():
    from parallel.comm import count_comm

    state = init_parallel(ParallelDims(1, 2), "cpu", MODEL["n_heads"], MODEL["n_kv_heads"])
    mc = ModelConfig(**MODEL)
    model = build_model(mc, state.tp_group, kv_replica_group(state, mc.n_kv_heads), seed=11)
    init_adapters(apply_lora(model, LoRAConfig(rank=4, alpha=8)), seed=3, b_std=0.05)
    with torch.no_grad(), adapters_disabled(model), count_comm() as off:
        model(IDS)
    with count_comm() as fwd:
        loss = model(IDS).pow(2).mean()
    with count_comm() as bwd:
        loss.backward()
    return [r.shape for r in off.records], [r.shape for r in fwd.records], [(r.kind, r.shape) for r in bwd.records]


@pytest.mark.slow
def test_adapters_add_no_forward_collective_and_one_small_backward_all_reduce_each(dist_pools):
    off, fwd, bwd = dist_pools.run(2, _collectives)[0]
    assert fwd == off  # the row adapters ride on the layers' own all-reduce
    layers, H, r = MODEL["n_layers"], MODEL["hidden_size"], 4
    assert sum(s == (r, H) for _, s in bwd) == 5 * layers  # dL/dA of q, k, v, gate, up
    assert sum(s == (H, r) for _, s in bwd) == 2 * layers  # dL/dB of o, down
    assert all(k == "all_reduce:sum" for k, s in bwd if s in ((r, H), (H, r)))


@pytest.mark.slow
def test_batch_invariant_lora_step0_kl_against_the_base_is_exactly_zero():
    """With B = 0 the adapted policy is its base: under parallel.batch_invariant the exact KL against
    the adapters-off reference is exactly 0 and the old-log-prob pass equals the update's forward."""
    from bench.bench_rl_step import CONFIGS, build_trainer

    torch.set_num_threads(1)
    flag = ["parallel.batch_invariant=true", "lora.rank=4", "lora.alpha=8"]
    drift = build_trainer(CONFIGS["tiny"], "grpo", extra=flag + ["algo.old_from_update=false"])
    assert isinstance(drift.ref, BaseReference)
    assert drift.step(0)["logp_drift"] == 0.0
    exact = build_trainer(CONFIGS["tiny"], "grpo", extra=flag + ["kl.exact=true"]).step(0)
    assert exact["kl_mean"] == 0.0
