"""Hugging Face checkpoints <-> kltron model checkpoints, streamed one tensor at a time.

    python -m tools.convert_hf import --hf-dir H --out C [--dtype fp32|bf16|fp16|keep]
                                     [--max-shard-bytes N] [--ignore-sliding-window]
    python -m tools.convert_hf export --ckpt C --hf-dir H

Supported: LlamaForCausalLM (Llama 2/3, llama3 / linear RoPE scaling), Qwen2ForCausalLM (Qwen2 /
2.5: qkv bias, tied embeddings), MistralForCausalLM. config.json comes in two layouts: transformers
5 writes `rope_parameters` (rope_theta inside) and `dtype`; hub checkpoints carry `rope_theta` /
`rope_scaling` at the top level and `torch_dtype`. Both import; export writes the hub layout.
Weights: model.safetensors, or shards listed in model.safetensors.index.json. The tokenizer files
(tokenizer.json, tokenizer_config.json, special_tokens_map.json, tokenizer.model,
generation_config.json: core.tokenizer.TOKENIZER_FILES) present are copied into the checkpoint --
so its manifest hashes them and `load_tokenizer(checkpoint)` works -- and the tokenizer's fingerprint
is recorded; export writes them back (from `--tokenizer-dir` if given, e.g. for an RL checkpoint).

kltron's attention is full causal: a Mistral config whose sliding_window is smaller than
max_position_embeddings is refused (sequences longer than the window would differ) unless
--ignore-sliding-window. Tensors keep their layout (rotate-half RoPE, as HF stores it), so the
mapping is names only; import then export reproduces every tensor bit for bit. Peak memory is
about the largest tensor (twice when casting), never the model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

import torch

from core.ckpt import (
    CheckpointError,
    StreamingWriter,
    dtype_name,
    open_safetensors_set,
    read_manifest,
    resolve_checkpoint,
    save_checkpoint_at,
    tensor_files,
    verify_files,
    write_bytes_atomic,
)
from core.ckpt.adapters import LORA_CONFIG, read_lora_config
from core.config import ModelConfig, from_dict, to_dict
from core.shards import full_param_shapes
from core.tokenizer import TOKENIZER_FILES, TokenizerError, load_tokenizer
from tools.peft_io import export_peft, is_factor, merged

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "keep": None}
ROPE_TYPES = ("default", "linear", "llama3")


class ConvertError(CheckpointError):
    """A Hugging Face checkpoint that cannot convert; the message names the file and the key."""


_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight",
          **{f"self_attn.{a}_proj.{k}": f"attn.w{a}.{k}" for a in "qkvo" for k in ("weight", "bias")},
          **{f"mlp.{a}_proj.weight": f"mlp.w_{a}.weight" for a in ("gate", "up", "down")}}
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED_RE = re.compile(r"\.rotary_emb\.inv_freq$")  # a buffer some old checkpoints stored


def hf_to_kltron_name(name: str) -> str | None:
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER:
        return f"layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def kltron_to_hf_name(name: str) -> str:
    inv_top = {v: k for k, v in _TOP.items()}
    if name in inv_top:
        return inv_top[name]
    _, i, rest = name.split(".", 2)
    inv_layer = {v: k for k, v in _LAYER.items()}
    return f"model.layers.{i}.{inv_layer[rest]}"


# ---------------------------------------------------------------------------------------------
# config.json


def _get(c: dict, key: str, where: str, default=...):
    if key in c and c[key] is not None:
        return c[key]
    if default is ...:
        raise ConvertError(f"{where}: missing key '{key}'")
    return default


def _size(c: dict, key: str, where: str, default=...) -> int:
    """A positive integer `key` of config.json, or ConvertError naming it (a string "256", 0, 1.5...)."""
    v = _get(c, key, where, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConvertError(f"{where}: key '{key}' must be a positive integer, found {v!r} ({type(v).__name__})")
    return v


def rope_from_hf(c: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config layout."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict):
        theta = _get(rp, "rope_theta", f"{where}: rope_parameters", c.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    else:
        theta = c.get("rope_theta", 10000.0)
        scaling = dict(c["rope_scaling"]) if isinstance(c.get("rope_scaling"), dict) else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ConvertError(f"{where}: rope scaling type {kind!r} is not supported (supported: {ROPE_TYPES})")
        if kind == "default":
            scaling = None
        else:
            scaling.pop("type", None)
            scaling["rope_type"] = kind
            need = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings")
            for k in need:
                _get(scaling, k, f"{where}: rope scaling")
    return float(theta), scaling


def _first_id(v):
    return v[0] if isinstance(v, list) and v else (v if isinstance(v, int) else None)


def model_config_from_hf(c: dict, where: str, ignore_sliding_window: bool = False) -> tuple[ModelConfig, str]:
    """(ModelConfig, architecture name); raises ConvertError naming `where` and the key."""
    archs = c.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    if arch not in ARCHITECTURES:
        raise ConvertError(f"{where}: key 'architectures' is {archs!r}; supported: {sorted(ARCHITECTURES)}")
    if _get(c, "hidden_act", where, "silu") != "silu":
        raise ConvertError(f"{where}: key 'hidden_act' is {c['hidden_act']!r}; only silu is supported")
    if c.get("mlp_bias"):
        raise ConvertError(f"{where}: key 'mlp_bias' is true; MLP biases are not supported")
    if arch != "Qwen2ForCausalLM" and c.get("attention_bias"):
        raise ConvertError(f"{where}: key 'attention_bias' is true (o_proj bias is not supported)")
    H, nh = _size(c, "hidden_size", where), _size(c, "num_attention_heads", where)
    max_pos = _size(c, "max_position_embeddings", where)
    window = c.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not c.get("use_sliding_window", False):
        window = None
    if window is not None and window < max_pos and not ignore_sliding_window:
        raise ConvertError(f"{where}: key 'sliding_window' is {window} < max_position_embeddings={max_pos}: "
                           f"kltron's attention is full causal, so sequences longer than {window} tokens would "
                           f"differ from {arch}; pass --ignore-sliding-window to convert anyway")
    theta, scaling = rope_from_hf(c, where)
    cfg = ModelConfig(
        vocab_size=_size(c, "vocab_size", where), hidden_size=H, n_layers=_size(c, "num_hidden_layers", where),
        n_heads=nh, n_kv_heads=_size(c, "num_key_value_heads", where, nh),
        intermediate_size=_size(c, "intermediate_size", where), head_dim=_size(c, "head_dim", where, H // nh),
        max_seq_len=max_pos, rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(_get(c, "rms_norm_eps", where, 1e-6)),
        qkv_bias=arch == "Qwen2ForCausalLM", tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_id=_first_id(c.get("bos_token_id")), eos_id=_first_id(c.get("eos_token_id")),
        pad_id=_first_id(c.get("pad_token_id")))
    try:
        cfg.validate()
    except ValueError as e:
        raise ConvertError(f"{where}: {e}") from e
    return cfg, arch


def hf_config_from_model(cfg: ModelConfig, dtype: str, source: dict | None) -> dict:
    """A hub-style config.json: top-level rope_theta/rope_scaling and torch_dtype."""
    c = dict(source or {})
    c.pop("rope_parameters", None)
    c.pop("dtype", None)
    arch = c.get("architectures", [None])[0] if c.get("architectures") else None
    if arch not in ARCHITECTURES:
        arch = "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"
    if cfg.qkv_bias != (arch == "Qwen2ForCausalLM"):
        raise ConvertError(f"qkv_bias={cfg.qkv_bias} cannot be written as {arch}")
    c.update(architectures=[arch], model_type=ARCHITECTURES[arch], vocab_size=cfg.vocab_size,
             hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
             num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.intermediate_size, head_dim=cfg.head_dim,
             max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta,
             rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None, rms_norm_eps=cfg.norm_eps,
             tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", torch_dtype=dtype)
    for key, v in (("bos_token_id", cfg.bos_id), ("eos_token_id", cfg.eos_id), ("pad_token_id", cfg.pad_id)):
        if key not in c or _first_id(c[key]) != v:
            c[key] = v
    return c


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
    except FileNotFoundError as e:
        raise ConvertError(f"{path}: not found") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: cannot read ({e})") from e
    if not isinstance(c, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return c


# ---------------------------------------------------------------------------------------------
# tokenizer files


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
    """Copy the files of core.tokenizer.TOKENIZER_FILES that `src` holds into the folder `dst`; returns
    their names. A model checkpoint's writer calls it on its temporary folder, so the manifest hashes them."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    for n in names:
        shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    return names


def tokenizer_fingerprint(folder: str) -> str | None:
    """The fingerprint of the tokenizer in `folder` (None when it holds no tokenizer.json / .model)."""
    if not any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer.model")):
        return None
    try:
        return load_tokenizer(folder).fingerprint
    except TokenizerError as e:
        raise ConvertError(str(e)) from e


# ---------------------------------------------------------------------------------------------
# import / export


def _check_out(out: str, force: bool) -> None:
    """Refuse to replace a checkpoint at `out`: a trained model (or, with `force`, only a model folder
    may be replaced; a training checkpoint and its optimizer state never are)."""
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        return
    try:
        m = read_manifest(out)
        kind, step = m.get("kind"), m.get("step")
    except CheckpointError:
        kind, step = "unreadable", None
    what = f"a kltron {kind} checkpoint of step {step}"
    if kind == "train":
        raise ConvertError(f"--out {out} holds {what} (weights and optimizer state); refusing to replace it: "
                           "choose another --out")
    if not force:
        raise ConvertError(f"--out {out} already holds {what}; refusing to replace it: choose another --out, or "
                           "pass --force to replace it")


def import_hf(hf_dir: str, out: str, dtype: str = "keep", max_shard_bytes: int | None = None,
              ignore_sliding_window: bool = False, force: bool = False) -> str:
    """Convert the HF checkpoint in `hf_dir` into a kltron model checkpoint folder `out`. An existing
    checkpoint at `out` is refused by name (`force`: a model checkpoint is replaced; never a training one)."""
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _check_out(out, force)
    cpath = os.path.join(hf_dir, "config.json")
    source = _read_json(cpath)
    cfg, arch = model_config_from_hf(source, cpath, ignore_sliding_window)
    shapes = full_param_shapes(cfg)
    want = DTYPES[dtype]
    with open_safetensors_set(hf_dir) as s:
        names, lm_head_stored = {}, False
        for key in s.keys():
            where = f"{s.file_of(key).path}: key '{key}'"
            if _IGNORED_RE.search(key):
                continue
            kn = hf_to_kltron_name(key)
            if kn == "lm_head.weight" and cfg.tie_embeddings:
                lm_head_stored = True  # tied: must equal the embedding; checked below, not stored twice
                continue
            if kn is None or kn not in shapes:
                raise ConvertError(f"{where}: unexpected tensor name for {arch} with this config.json")
            if tuple(s.shape(key)) != shapes[kn]:
                raise ConvertError(f"{where}: expected shape {list(shapes[kn])}, found {list(s.shape(key))}")
            names[kn] = key
        missing = [kltron_to_hf_name(n) for n in shapes if n not in names]
        if missing:
            raise ConvertError(f"{s.origin}: missing key '{missing[0]}'"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        if lm_head_stored and not torch.equal(s.get("lm_head.weight"), s.get("model.embed_tokens.weight")):
            raise ConvertError(f"{s.file_of('lm_head.weight').path}: key 'lm_head.weight' differs from "
                               f"model.embed_tokens.weight although tie_word_embeddings is true")
        specs = {n: (want or s.dtype(names[n]), shapes[n]) for n in shapes}
        fingerprint = tokenizer_fingerprint(hf_dir)
        info = {"kind": "model", "model_config": to_dict(cfg), "tp": 1,
                "dtype": ",".join(sorted({dtype_name(dt) for dt, _ in specs.values()})),
                "tokenizer_fingerprint": fingerprint,
                "source": {"format": "huggingface", "architecture": arch, "config": source,
                           "lm_head_stored": lm_head_stored, "sliding_window": source.get("sliding_window")}}

        def write(tmp: str) -> None:
            with StreamingWriter(tmp, "model", specs, max_shard_bytes, {"format": "pt"}) as w:
                for n in w.order:  # one tensor in memory at a time
                    w.write(n, s.get(names[n]).to(specs[n][0]))
                w.close()
            copy_tokenizer_files(hf_dir, tmp)  # hashed into the manifest's `files` with the weights

        return save_checkpoint_at(out, 0, write, info=info)


def export_hf(ckpt: str, hf_dir: str, max_shard_bytes: int | None = None, tokenizer_dir: str | None = None,
              verify: bool = True, merge_lora: bool = False, peft: bool = False) -> str:
    """Write config.json + model.safetensors + the tokenizer files (from `tokenizer_dir`, default the
    checkpoint itself) for checkpoint `ckpt` into `hf_dir`. `verify`: first hash the files it reads
    against the checkpoint's manifest (a mismatch is refused by name). A checkpoint with LoRA adapters
    (tools/peft_io.py) needs `merge_lora` (W + s B A written) or `peft` (a PEFT adapter folder instead)."""
    ckpt = resolve_checkpoint(ckpt)
    m = read_manifest(ckpt)
    if verify:
        tok = [n for n in TOKENIZER_FILES if tokenizer_dir is None and n in m.get("files", {})]
        lora_cfg = [n for n in (LORA_CONFIG,) if n in m.get("files", {})]
        verify_files(ckpt, m, tensor_files(ckpt, m, "model") + tok + lora_cfg)
    cfg = from_dict(ModelConfig, m["model_config"])
    src = m.get("source") or {}
    os.makedirs(hf_dir, exist_ok=True)
    stale = [n for n in os.listdir(hf_dir) if n.startswith("model") and ".safetensors" in n]
    if stale:
        raise ConvertError(f"{hf_dir}: already holds {stale[0]}; export into an empty folder")
    shapes = full_param_shapes(cfg)
    with open_safetensors_set(ckpt) as s:
        factors = [n for n in s.keys() if is_factor(n)]
        if factors and not (merge_lora or peft):
            raise ConvertError(f"{ckpt}: holds LoRA adapters ({len(factors)} factors): pass --merge-lora (the "
                               f"merged weights) or --peft (a PEFT adapter folder)")
        if peft:
            if not factors:
                raise ConvertError(f"{ckpt}: --peft: the checkpoint holds no LoRA factors")
            return export_peft(s.get, factors, read_lora_config(ckpt), hf_dir)  # norms: w + d (modules_to_save)
        lora = read_lora_config(ckpt) if factors else None
        for n in s.keys():
            if n not in shapes and not is_factor(n):
                raise ConvertError(f"{s.file_of(n).path}: unexpected key '{n}'")
        missing = [n for n in shapes if n not in s]
        if missing:
            raise ConvertError(f"{s.origin}: missing key '{missing[0]}'")
        out = {kltron_to_hf_name(n): n for n in shapes}
        if cfg.tie_embeddings and src.get("lm_head_stored"):
            out["lm_head.weight"] = "embed.weight"
        specs = {h: (s.dtype(n), shapes[n]) for h, n in out.items()}
        with StreamingWriter(hf_dir, "model", specs, max_shard_bytes, {"format": "pt"}) as w:
            for h in w.order:
                w.write(h, s.get(out[h]) if lora is None else merged(s.get, out[h], lora, factors))
            w.close()
    dtypes = {dtype_name(dt) for dt, _ in specs.values()}
    config = hf_config_from_model(cfg, dtypes.pop() if len(dtypes) == 1 else "float32", src.get("config"))
    write_bytes_atomic(os.path.join(hf_dir, "config.json"), json.dumps(config, indent=2).encode("utf-8"))
    if not copy_tokenizer_files(tokenizer_dir or ckpt, hf_dir):
        print(f"kltron.convert_hf: warning: {tokenizer_dir or ckpt} holds no tokenizer files "
              f"({', '.join(TOKENIZER_FILES)}), so {hf_dir} has none and transformers cannot load a tokenizer from "
              "it; pass --tokenizer-dir (a run's model/ folder or the converted start checkpoint)", file=sys.stderr)
    return hf_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.convert_hf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    im = sub.add_parser("import", help="Hugging Face folder -> kltron model checkpoint")
    im.add_argument("--hf-dir", required=True)
    im.add_argument("--out", required=True)
    im.add_argument("--dtype", default="keep", choices=sorted(DTYPES))
    im.add_argument("--max-shard-bytes", type=int, default=None)
    im.add_argument("--ignore-sliding-window", action="store_true")
    im.add_argument("--force", action="store_true",
                    help="replace a model checkpoint already at --out (a training checkpoint is never replaced)")
    ex = sub.add_parser("export", help="kltron checkpoint -> Hugging Face folder")
    ex.add_argument("--ckpt", required=True)
    ex.add_argument("--hf-dir", required=True)
    ex.add_argument("--max-shard-bytes", type=int, default=None)
    ex.add_argument("--tokenizer-dir", default=None, help="copy the tokenizer files from here (default: --ckpt)")
    ex.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the files read")
    ex.add_argument("--merge-lora", action="store_true", help="LoRA checkpoint: write W + s B A (a plain model)")
    ex.add_argument("--peft", action="store_true", help="LoRA checkpoint: write a PEFT adapter folder to --hf-dir")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "import":
            path = import_hf(args.hf_dir, args.out, args.dtype, args.max_shard_bytes, args.ignore_sliding_window,
                             args.force)
        else:
            path = export_hf(args.ckpt, args.hf_dir, args.max_shard_bytes, args.tokenizer_dir,
                             verify=not args.no_verify, merge_lora=args.merge_lora, peft=args.peft)
    except CheckpointError as e:
        print(f"kltron.convert_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"kltron.convert_hf: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
