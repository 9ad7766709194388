"""Model weights and train checkpoints across layouts: save at tp=2 x dp=2 (FSDP), load at tp=1,
tp=4 and dp=4; train N + resume N == 2N bitwise; bad checkpoints give one error on every rank.

References: the saving run's own parameters and AdamW state, gathered over FSDP with
`DTensor.full_tensor` and concatenated over tp by hand (not through core/ckpt/model_weights), and, for
resume, the uninterrupted run."""

from __future__ import annotations

import os

import pytest
import torch

import core.ckpt as ck
from core.ckpt import CheckpointError
from core.config import ModelConfig, OptimConfig, to_dict
from core.model import Transformer, build_model, local_shard
from core.optim import build_optimizer
from core.sft_data import SequenceLoader
from core.shards import full_param_shapes
from parallel.comm import all_reduce
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from parallel.fsdp import FSDPOptions, full_tensor, parallelize
from parallel.vocab import vocab_parallel_cross_entropy
from rl.models.critic import Critic

CFG = dict(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64, max_seq_len=16)
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, grad_clip=1.0)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**CFG, **kw}).validate()


def _setup(dp, tp, c):
    state = init_parallel(ParallelDims(dp, tp), "cpu", c.n_heads, c.n_kv_heads)
    kv = kv_replica_group(state, c.n_kv_heads)
    return state, kv


def _tokens():
    return torch.randint(0, CFG["vocab_size"], (4000,), generator=torch.Generator().manual_seed(0))


def _step(model, critic, opts, batch, state, c):
    """One step: policy cross entropy (vocab-parallel) plus the critic's value MSE to 0.5."""
    ids, tgt = batch.input_ids, batch.targets
    n = torch.tensor([float(tgt.numel())])
    all_reduce(n, "sum", state.dp_group if state else None)  # global token count over dp

    def head(h, w):
        from parallel.layers import vocab_parallel_logits

        logits = vocab_parallel_logits(h, w, state.tp_group if state else None)
        return vocab_parallel_cross_entropy(logits, tgt, state.tp_group if state else None, vocab_size=c.vocab_size)

    loss = model(ids, head=head).sum() / n
    loss.backward()
    vloss = ((critic(ids) - 0.5) ** 2).sum() / n
    vloss.backward()
    for o in opts:
        o.step()
    total = loss.detach().reshape(1).clone()
    all_reduce(total, "sum", state.dp_group if state else None)  # each dp rank holds its share of the mean
    return float(total)


def _build(dp, tp, c, state, kv, seed):
    model = build_model(c, state.tp_group, kv, seed=seed) if seed is not None else \
        Transformer(c, state.tp_group, kv, device="meta").to_empty(device="cpu")
    critic = Critic(c, state.tp_group, kv, device="meta").to_empty(device="cpu")
    if seed is not None:
        critic.body.init_weights(seed + 1)
        with torch.no_grad():
            critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(seed))
            critic.value_head.bias.fill_(0.1)
    model = parallelize(model, state.dp_mesh, FSDPOptions())
    critic = parallelize(critic, state.dp_mesh, FSDPOptions())
    opt = build_optimizer(model, OPTIM, c, 10, state.tp_group, state.dp_group)
    copt = build_optimizer(critic, OPTIM, c, 10, state.tp_group, state.dp_group)
    return model, critic, opt, copt


def _tp_local_state(module, opt):
    """{name: {"param": TP-local, "exp_avg": .., ...}} gathered over FSDP with DTensor.full_tensor."""
    out = {}
    for name, p in module.named_parameters():
        st = opt.opt.state[p]
        out[name] = {"param": full_tensor(p.detach()).clone(),
                     **{k: full_tensor(st[k]).clone() for k in STATE_KEYS}}
    return out


# ---------------------------------------------------------------------------------------------
# reshard: save at tp=2 x dp=2, load at tp=1, tp=4, dp=4


def _save_run(root, model_dir):
    c = cfg()
    state, kv = _setup(2, 2, c)
    model, critic, opt, copt = _build(2, 2, c, state, kv, seed=5)
    loader = SequenceLoader(_tokens(), 8, 2, 3, state.dp_rank, 2)
    for _ in range(2):
        _step(model, critic, [opt, copt], next(loader), state, c)
    ck.save_train_checkpoint(root, 2, state, {"policy": (model, opt), "critic": (critic, copt)},
                             extra={"data": loader.state_dict()}, keep_last=1, tokenizer_fingerprint="f" * 64)
    ck.save_model_weights(model, model_dir, state, tokenizer_fingerprint="f" * 64, max_shard_bytes=4096)
    return {"tp_rank": state.tp_rank, "dp_rank": state.dp_rank, "policy": _tp_local_state(model, opt),
            "critic": _tp_local_state(critic, copt)}


def _reference_full(results, c):
    """Full tensors from the tp=2 ranks' TP-local tensors (dp rank 0): cat over tp, cut the padding."""
    shapes = full_param_shapes(c)
    by_tp = {r["tp_rank"]: r for r in results if r["dp_rank"] == 0}
    full = {}
    for mod in ("policy", "critic"):
        for name, d in by_tp[0][mod].items():
            model_name = name.removeprefix("body.")
            for key, t0 in d.items():
                t1 = by_tp[1][mod][name][key]
                if model_name not in shapes or t0.dim() == 0 or torch.equal(t0, t1) and t0.dim() == 1:
                    full[(mod, name, key)] = t0
                    continue
                dim = 1 if model_name.split(".")[-2] in ("wo", "w_down") else 0
                whole = torch.cat([t0, t1], dim=dim)
                full[(mod, name, key)] = whole.narrow(dim, 0, shapes[model_name][dim])
    return full


def _load_run(root, model_dir, dp, tp):
    c = cfg()
    state, kv = _setup(dp, tp, c)
    model, critic, opt, copt = _build(dp, tp, c, state, kv, seed=None)
    extra = ck.load_train_checkpoint(root, state, {"policy": (model, opt), "critic": (critic, copt)})
    plain = Transformer(c, state.tp_group, kv, device="meta").to_empty(device="cpu")
    ck.load_model_weights(plain, model_dir, state, tokenizer_fingerprint="f" * 64)
    return {"tp_rank": state.tp_rank, "dp_rank": state.dp_rank, "extra": extra, "counts": (opt.step_count,
            copt.step_count), "policy": _tp_local_state(model, opt), "critic": _tp_local_state(critic, copt),
            "plain": {n: p.detach().clone() for n, p in plain.named_parameters()}}


def _expect_local(full, mod, name, c, tp_rank, tp):
    model_name = name.removeprefix("body.")
    if model_name in full_param_shapes(c) and full.dim() > 0:
        return local_shard(full, model_name, c, tp_rank, tp)
    return full


@pytest.fixture(scope="module")
def saved(dist_pools, tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard")
    root, model_dir = str(d / "train"), str(d / "model")
    results = dist_pools.run(4, _save_run, root, model_dir)
    return root, model_dir, _reference_full(results, cfg())


def _compare(results, full, c, tp):
    for r in results:
        assert r["extra"]["step"] == 2 and r["counts"] == (2, 2) and r["extra"]["data"]["offset"] > 0
        for mod in ("policy", "critic"):
            for name, d in r[mod].items():
                for key, got in d.items():
                    want = _expect_local(full[(mod, name, key)], mod, name, c, r["tp_rank"], tp)
                    assert torch.equal(got, want), f"{mod} {name} {key} at tp rank {r['tp_rank']}/{tp}"
        for name, got in r["plain"].items():
            assert torch.equal(got, _expect_local(full[("policy", name, "param")], "policy", name, c,
                                                  r["tp_rank"], tp)), name


@pytest.mark.slow
def test_reshard_tp2dp2_to_tp1(saved):
    root, model_dir, full = saved
    assert ck.read_manifest(ck.find_latest(root))["tp"] == 2
    _compare([_load_run(root, model_dir, 1, 1)], full, cfg(), 1)


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(1, 4), (4, 1)])
def test_reshard_tp2dp2_to_other_layouts(dist_pools, saved, dp, tp):
    root, model_dir, full = saved
    _compare(dist_pools.run(4, _load_run, root, model_dir, dp, tp), full, cfg(), tp)


# ---------------------------------------------------------------------------------------------
# train N, save, resume, train N == train 2N


def _resume_run(root, dp, tp, n):
    c = cfg()
    state, kv = _setup(dp, tp, c)

    def fresh(seed):
        model, critic, opt, copt = _build(dp, tp, c, state, kv, seed)
        return model, critic, [opt, copt], SequenceLoader(_tokens(), 8, 2, 3, state.dp_rank, dp)

    torch.manual_seed(0)
    model, critic, opts, loader = fresh(5)
    straight = [_step(model, critic, opts, next(loader), state, c) for _ in range(2 * n)]
    model, critic, opts, loader = fresh(5)
    first = [_step(model, critic, opts, next(loader), state, c) for _ in range(n)]
    mods = {"policy": (model, opts[0]), "critic": (critic, opts[1])}
    ck.save_train_checkpoint(root, n, state, mods, extra={"data": loader.state_dict()})
    model, critic, opts, loader = fresh(None)  # garbage weights until loaded
    extra = ck.load_train_checkpoint(root, state, {"policy": (model, opts[0]), "critic": (critic, opts[1])})
    loader.load_state_dict(extra["data"])
    second = [_step(model, critic, opts, next(loader), state, c) for _ in range(n)]
    return straight, first + second


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_resume_is_bitwise(dist_pools, tmp_path, dp, tp):
    for straight, resumed in dist_pools.run(2, _resume_run, str(tmp_path / f"r{dp}{tp}"), dp, tp, 3):
        assert straight == resumed, f"{straight} vs {resumed}"
        assert len(set(straight)) == len(straight)  # the loss moves: the steps did something


# ---------------------------------------------------------------------------------------------
# bad checkpoints: one clear error on every rank


def _write_variant(path, tensors, c, fp="a" * 64):
    info = {"kind": "model", "model_config": to_dict(c), "tp": 1, "dtype": "float32", "tokenizer_fingerprint": fp}
    return ck.save_checkpoint_at(path, 0, lambda d: ck.write_tensors(d, tensors), info=info)


def _load_error(path, fp, **cfg_kw):
    c = cfg(**cfg_kw)
    state, kv = _setup(1, 2, c)
    model = Transformer(c, state.tp_group, kv, device="meta").to_empty(device="cpu")
    try:
        ck.load_model_weights(model, path, state, tokenizer_fingerprint=fp, what="reference")
    except CheckpointError as e:
        return str(e)
    return None


def test_bad_checkpoints_fail_on_every_rank(dist_pools, tmp_path):
    c = cfg()
    full = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) for n, s in full_param_shapes(c).items()}
    good = _write_variant(str(tmp_path / "good"), full, c)
    missing = _write_variant(str(tmp_path / "missing"), {k: v for k, v in full.items() if k != "norm.weight"}, c)
    extra = _write_variant(str(tmp_path / "extra"), {**full, "layers.9.attn.wq.weight": torch.zeros(2)}, c)
    shape = _write_variant(str(tmp_path / "shape"), {**full, "layers.1.mlp.w_up.weight": torch.zeros(64, 31)}, c)
    cases = [
        (missing, "a" * 64, {}, "missing key 'norm.weight'"),
        (extra, "a" * 64, {}, "unexpected key 'layers.9.attn.wq.weight'"),
        (shape, "a" * 64, {}, r"key 'layers.1.mlp.w_up.weight': expected shape [64, 32], found [64, 31]"),
        (good, "a" * 64, {"norm_eps": 1e-6}, "model config field 'norm_eps' differs: checkpoint has 1e-05"),
        (good, "b" * 64, {}, "tokenizer mismatch (reference checkpoint"),
        (str(tmp_path / "nothing"), None, {}, "not a kltron checkpoint"),
    ]
    for path, fp, kw, msg in cases:
        errs = dist_pools.run(2, _load_error, path, fp, **kw)
        assert errs[0] is not None and errs[0] == errs[1], errs
        assert msg in errs[0], (msg, errs[0])
    assert dist_pools.run(2, _load_error, good, "a" * 64) == [None, None]


# ---------------------------------------------------------------------------------------------
# single process


def test_save_at_path_replaces_checkpoint_refuses_other_folder_and_casts(tmp_path):
    c = cfg(tie_embeddings=True, qkv_bias=True)
    a, b = build_model(c, seed=1), build_model(c, seed=2)
    path = str(tmp_path / "m")
    ck.save_model_weights(a, path, None)
    ck.save_model_weights(b, path, None, dtype=torch.bfloat16, step=7)  # replaces it
    assert ck.read_manifest(path)["step"] == 7 and ck.read_manifest(path)["dtype"] == "bfloat16"
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp")] == []
    m = Transformer(c, device="meta").to_empty(device="cpu")
    ck.load_model_weights(m, path, None)
    for (n, p), q in zip(m.named_parameters(), b.parameters()):
        assert torch.equal(p, q.bfloat16().float()), n
    ids = torch.randint(0, c.vocab_size, (2, 5))
    torch.testing.assert_close(m(ids), build_model(c, seed=2)(ids), atol=0.05, rtol=0.05)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(CheckpointError, match="exists and is not a kltron checkpoint; refusing"):
        ck.save_model_weights(a, str(run), None)
    assert (run / "metrics.jsonl").read_text() == "{}\n"


def test_critic_body_ignores_lm_head_and_rope_is_recomputed(tmp_path):
    c = cfg()
    src = build_model(c, seed=4)
    ck.save_model_weights(src, str(tmp_path / "m"), None)
    critic = Critic(c, device="meta").to_empty(device="cpu")
    ck.load_model_weights(critic.body, str(tmp_path / "m"), None, what="critic")
    ids = torch.randint(0, c.vocab_size, (1, 6))
    want = src(ids, head=lambda h, w: h)
    torch.testing.assert_close(critic.body(ids, head=lambda h, w: h), want, atol=0, rtol=0)
