"""tools/convert_hf against transformers: logits of converted random Llama-3 (llama3 RoPE scaling),
Qwen2 (qkv bias, tied, sharded files) and Mistral checkpoints at tp 1 and 2 equal transformers'
within 1e-4 (fp32); export reproduces every original tensor bit for bit; bad input names the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.ckpt import CheckpointError, load_model_weights, read_manifest
from core.config import ModelConfig, from_dict
from core.model import Transformer
from parallel.comm import all_gather_along
from parallel.dims import ParallelDims, init_parallel
from tests.dist import REPO
from tests.helpers import make_hf
from tools.convert_hf import ConvertError, export_hf, import_hf

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 131, (2, 24), generator=torch.Generator().manual_seed(3))


def _kltron_logits(ckpt: str, dp: int, tp: int, seq: int):
    state = init_parallel(ParallelDims(dp, tp), "cpu")
    cfg = from_dict(ModelConfig, read_manifest(ckpt)["model_config"])
    model = Transformer(cfg, state.tp_group, device="meta").to_empty(device="cpu")
    load_model_weights(model, ckpt, state)
    with torch.no_grad():
        local = model(IDS[:, :seq])  # (B, S, Vp/tp)
    return all_gather_along(local, -1, state.tp_group)[..., :cfg.vocab_size]  # test only: whole vocabulary


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("llama", "qwen2", "mistral"):
        hf = make_hf(kind, str(d / f"{kind}_hf"))
        ckpt = str(d / f"{kind}_kl")
        import_hf(str(d / f"{kind}_hf"), ckpt, ignore_sliding_window=kind == "mistral")
        seq = 8 if kind == "mistral" else 24  # mistral: within its sliding window
        with torch.no_grad():
            out[kind] = (str(d / f"{kind}_hf"), ckpt, hf(IDS[:, :seq]).logits, seq)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.slow
def test_logits_match_transformers(dist_pools, converted, kind):
    _, ckpt, want, seq = converted[kind]
    assert want.abs().max() > 1.0
    torch.testing.assert_close(_kltron_logits(ckpt, 1, 1, seq), want, atol=1e-4, rtol=1e-4)
    for got in dist_pools.run(2, _kltron_logits, ckpt, 1, 2, seq):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_export_reproduces_every_tensor(converted, tmp_path, kind):
    hf_dir, ckpt, want, seq = converted[kind]
    export_hf(ckpt, str(tmp_path / "out"))
    orig = {}
    if kind == "qwen2":  # sharded original
        idx = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
        for f in set(idx["weight_map"].values()):
            orig.update(load_file(os.path.join(hf_dir, f)))
    else:
        orig = load_file(os.path.join(hf_dir, "model.safetensors"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(back) == sorted(orig)
    for k, v in orig.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    c = json.load(open(tmp_path / "out" / "config.json"))
    assert "rope_parameters" not in c and c["torch_dtype"] == "float32" and "rope_theta" in c
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS[:, :seq]).logits, want, atol=1e-5, rtol=1e-5)


def test_hub_style_config_and_dtype(converted, tmp_path):
    """The hub layout (top-level rope_theta/rope_scaling, torch_dtype) converts the same; bf16 casts."""
    hf_dir, _, want, seq = converted["llama"]
    hub = tmp_path / "hub"
    hub.mkdir()
    c = json.load(open(os.path.join(hf_dir, "config.json")))
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = rp
    c["torch_dtype"] = c.pop("dtype")
    (hub / "config.json").write_text(json.dumps(c))
    os.link(os.path.join(hf_dir, "model.safetensors"), hub / "model.safetensors")
    import_hf(str(hub), str(tmp_path / "kl"))
    assert read_manifest(str(tmp_path / "kl"))["model_config"]["rope_scaling"]["rope_type"] == "llama3"
    torch.testing.assert_close(_kltron_logits(str(tmp_path / "kl"), 1, 1, seq), want, atol=1e-4, rtol=1e-4)
    import_hf(str(hub), str(tmp_path / "kl16"), dtype="bf16")
    assert read_manifest(str(tmp_path / "kl16"))["dtype"] == "bfloat16"


def test_bad_input_names_file_and_key(converted, tmp_path):
    hf_dir = converted["llama"][0]

    def variant(name, edit_config=None, edit_tensors=None):
        d = tmp_path / name
        d.mkdir()
        c = json.load(open(os.path.join(hf_dir, "config.json")))
        if edit_config:
            edit_config(c)
        (d / "config.json").write_text(json.dumps(c))
        ts = load_file(os.path.join(hf_dir, "model.safetensors"))
        if edit_tensors:
            edit_tensors(ts)
        save_file(ts, str(d / "model.safetensors"))
        return str(d)

    cases = [
        (variant("arch", lambda c: c.update(architectures=["GPT2LMHeadModel"])), r"key 'architectures'"),
        (variant("nokey", lambda c: c.pop("hidden_size")), r"config.json: missing key 'hidden_size'"),
        (variant("extra", None, lambda t: t.update({"model.layers.0.foo.weight": torch.zeros(2)})),
         r"model.safetensors: key 'model.layers.0.foo.weight': unexpected tensor name"),
        (variant("missing", None, lambda t: t.pop("model.norm.weight")), r"missing key 'model.norm.weight'"),
        (variant("yarn", lambda c: c["rope_parameters"].update(rope_type="yarn")), r"rope scaling type 'yarn'"),
    ]
    for d, msg in cases:
        with pytest.raises(ConvertError, match=msg):
            import_hf(d, str(tmp_path / "never"))
    assert not os.path.exists(tmp_path / "never")
    with pytest.raises(ConvertError, match=r"'sliding_window' is 8 < max_position_embeddings=64.*full causal"):
        import_hf(converted["mistral"][0], str(tmp_path / "never"))


@pytest.mark.slow
def test_cli(converted, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    run = [sys.executable, "-m", "tools.convert_hf"]
    ok = subprocess.run(run + ["import", "--hf-dir", converted["qwen2"][0], "--out", str(tmp_path / "c")],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert read_manifest(str(tmp_path / "c"))["model_config"]["tie_embeddings"] is True
    bad = subprocess.run(run + ["import", "--hf-dir", str(tmp_path / "none"), "--out", str(tmp_path / "d")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "config.json: not found" in bad.stderr


def test_export_refuses_a_corrupt_checkpoint(tmp_path):
    """A flipped data byte in a converted model.safetensors: export refuses it by name (or, with
    verify=False, writes what is there)."""
    make_hf("llama", str(tmp_path / "hf"), seed=4)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "k"))
    path = tmp_path / "k" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little") + 3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{path}: sha256 mismatch"):
        export_hf(str(tmp_path / "k"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")
    export_hf(str(tmp_path / "k"), str(tmp_path / "out2"), verify=False)
    assert os.path.exists(tmp_path / "out2" / "model.safetensors")
