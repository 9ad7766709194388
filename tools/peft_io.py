"""LoRA adapters out of (and into) kltron checkpoints: merged weights, or a PEFT adapter folder.

A LoRA run's model folder holds the frozen base's tensors under their usual names, each adapter's
factors as `<base>.lora.lora_A` [r, in] / `<base>.lora.lora_B` [out, r] (full, unsharded), with
`lora.train_norms` each norm's delta `<norm>.lora.lora_d` [H], and `lora_config.json` (rank, alpha,
rslora, targets, dropout, train_norms; hashed in the manifest like every file).

    python -m tools.convert_hf export --ckpt C --hf-dir H --merge-lora   # W + s B A, a plain HF model
    python -m tools.convert_hf export --ckpt C --hf-dir P --peft         # adapter_config.json +
                                                                         # adapter_model.safetensors

The PEFT folder uses PEFT's names (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)
and config keys (r, lora_alpha, use_rslora, target_modules), so `peft.PeftModel.from_pretrained`
applies it to the base exported by plain `export` of the starting checkpoint. Trained norms go in as
PEFT `modules_to_save` (input_layernorm, post_attention_layernorm, norm): full weights w + d in fp32
(or wider), under base_model.model.model.layers.0.input_layernorm.weight. core/ckpt/adapters.py's
`read_peft` maps such a folder back to kltron's names and LoRA config (`lora.init_from`).
"""

from __future__ import annotations

import json
import os
import re

import torch

from core.ckpt import CheckpointError
from core.ckpt.adapters import PEFT_NORMS
from core.shards import LORA_TAG
from parallel.lora import TARGETS, LoRAConfig

_HF_MODULE = {attr: hf for _, attr, hf in TARGETS.values()}  # wq -> self_attn.q_proj
_KEY = {attr: key for key, (_, attr, _) in TARGETS.items()}  # wq -> q
_FACTOR_RE = re.compile(r"^layers\.(\d+)\.(attn|mlp)\.(\w+)\.lora\.lora_([AB])$")


class AdapterError(CheckpointError):
    """A LoRA checkpoint or PEFT folder that cannot convert; the message names the file and the key."""


def is_factor(name: str) -> bool:
    return LORA_TAG in name


def merged(get, name: str, lora: LoRAConfig, keys) -> torch.Tensor:
    """The tensor `name` read by `get`, with s B A added when the checkpoint holds its adapter (in
    fp32, or fp64 for an fp64 weight; cast back to the weight's dtype)."""
    w = get(name)
    stem = name[:-len(".weight")] if name.endswith(".weight") else None
    if stem is not None and f"{stem}.lora.lora_d" in keys:  # a trained norm: w + d
        return norm_weight(get, name).to(w.dtype)
    if stem is None or f"{stem}.lora.lora_A" not in keys:
        return w
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    a, b = get(f"{stem}.lora.lora_A").to(acc), get(f"{stem}.lora.lora_B").to(acc)
    return (w.to(acc) + (b @ a) * lora.scaling).to(w.dtype)


def norm_weight(get, name: str) -> torch.Tensor:
    """w + d of the trained norm `name` (its delta `<norm>.lora.lora_d`), in fp32 or wider."""
    w, d = get(name), get(f"{name[:-len('.weight')]}.lora.lora_d")
    acc = torch.promote_types(torch.promote_types(w.dtype, d.dtype), torch.float32)
    return w.to(acc) + d.to(acc)


def peft_norm_name(name: str) -> str:
    """kltron norm weight name -> PEFT modules_to_save key: layers.0.attn_norm.weight -> base_model.model.
    model.layers.0.input_layernorm.weight, norm.weight -> base_model.model.model.norm.weight."""
    hf = {k: h for h, k in PEFT_NORMS.items()}
    parts = name.split(".")
    if name == "norm.weight":
        return "base_model.model.model.norm.weight"
    if len(parts) != 4 or parts[0] != "layers" or parts[2] not in ("attn_norm", "mlp_norm") or parts[3] != "weight":
        raise AdapterError(f"not a norm weight name: '{name}'")
    return f"base_model.model.model.layers.{parts[1]}.{hf[parts[2]]}.weight"


def peft_name(name: str) -> str:
    """kltron factor name -> PEFT key: layers.0.attn.wq.lora.lora_A -> base_model.model.model.layers.0.
    self_attn.q_proj.lora_A.weight."""
    m = _FACTOR_RE.match(name)
    if m is None or m.group(3) not in _HF_MODULE:
        raise AdapterError(f"not a LoRA factor name: '{name}'")
    return f"base_model.model.model.layers.{m.group(1)}.{_HF_MODULE[m.group(3)]}.lora_{m.group(4)}.weight"


def peft_config(lora: LoRAConfig, base_model: str | None = None) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "use_rslora": lora.rslora, "bias": "none", "fan_in_fan_out": False,
            "target_modules": sorted(_HF_MODULE[TARGETS[t][1]].split(".")[1] for t in lora.targets),
            "base_model_name_or_path": base_model, "inference_mode": True,
            "modules_to_save": sorted(PEFT_NORMS) if lora.train_norms else None}


def export_peft(get, names, lora: LoRAConfig, out: str) -> str:
    """A PEFT folder from a checkpoint's tensors (`get`) whose LoRA names are `names`: the factors as they
    are, each trained norm (a `.lora.lora_d`) as its full weight w + d."""
    norms = [n.split(".lora.")[0] + ".weight" for n in names if n.endswith(".lora.lora_d")]
    return write_peft({n: get(n) for n in names if not n.endswith(".lora.lora_d")}, lora, out,
                      norms={n: norm_weight(get, n) for n in norms})


def write_peft(factors: dict[str, torch.Tensor], lora: LoRAConfig, out: str, base_model: str | None = None,
               norms: dict[str, torch.Tensor] | None = None) -> str:
    """adapter_config.json + adapter_model.safetensors in `out` from {kltron factor name: full tensor} and,
    with `lora.train_norms`, {norm weight name: full trained weight} (PEFT's modules_to_save)."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, "adapter_model.safetensors")):
        raise AdapterError(f"{out}: already holds adapter_model.safetensors; export into an empty folder")
    if bool(norms) != lora.train_norms:
        raise AdapterError(f"{out}: lora_config.json gives train_norms {lora.train_norms}, the checkpoint holds "
                           f"{len(norms or {})} norm deltas")
    tensors = {peft_name(n): t.detach().contiguous() for n, t in factors.items()}
    tensors.update({peft_norm_name(n): t.detach().contiguous() for n, t in (norms or {}).items()})
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(peft_config(lora, base_model), f, indent=2)
    return out
