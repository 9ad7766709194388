"""What a checkpoint records about LoRA adapters (parallel/lora.py), adapter-only checkpoints, and
PEFT adapter folders read back (`lora.init_from`).

`lora_config.json` beside the tensors: rank, alpha, rslora, targets, dropout, train_norms -- what the
factors `<base>.lora.lora_A` / `lora_B` (and the norm deltas `<norm>.lora.lora_d`) in the safetensors
files need to mean a function (tools/peft_io.py reads it to merge or to write a PEFT folder). It is
one of the checkpoint's files, so the manifest hashes it like the rest.

A PEFT folder's norms (`modules_to_save`: input_layernorm, post_attention_layernorm, norm) hold full
weights w_base + d; `read_peft` returns them by kltron weight name beside the factors and core/lora.py's
`load_adapter_factors` turns them back into d = w_saved - w_base on the run's base.
"""

from __future__ import annotations

import json
import os
import re

import torch
import torch.nn as nn

from core.ckpt.atomic import CheckpointError, sha256_file
from core.ckpt.manifest import MANIFEST, resolve_checkpoint
from core.ckpt.safetensors_read import open_safetensors
from core.shards import LORA_TAG
from parallel.lora import TARGETS, LoRAConfig, apply_lora

LORA_CONFIG = "lora_config.json"
_PEFT_RE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")
_PEFT_NORM_RE = re.compile(r"^base_model\.model\.model\.(?:layers\.(\d+)\.)?"
                           r"(input_layernorm|post_attention_layernorm|norm)\.weight$")
PEFT_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm", "norm": "norm"}


def write_lora_config(folder: str, cfg: LoRAConfig) -> str:
    """Write `folder/lora_config.json`; returns its path (for `extra_files` of a checkpoint save)."""
    path = os.path.join(folder, LORA_CONFIG)
    with open(path, "w") as f:
        json.dump({"rank": cfg.rank, "alpha": cfg.alpha, "rslora": cfg.rslora, "targets": list(cfg.targets),
                   "dropout": cfg.dropout, "train_norms": cfg.train_norms}, f, indent=1)
    return path


def read_lora_config(ckpt: str) -> LoRAConfig:
    path = os.path.join(ckpt, LORA_CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt}: holds LoRA factors but no {LORA_CONFIG} (rank, alpha, targets)")
    try:
        with open(path) as f:
            d = json.load(f)
        return LoRAConfig(rank=int(d["rank"]), alpha=float(d["alpha"]), rslora=bool(d.get("rslora", False)),
                          targets=list(d["targets"]), dropout=float(d.get("dropout", 0.0)),
                          train_norms=bool(d.get("train_norms", False)))
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from e


# ---------------------------------------------------------------------------------------------
# adapter-only training checkpoints


class AdapterView(nn.Module):
    """The LoRA factors of `model` alone, under the model's parameter names: a training checkpoint of
    it (module name "adapters") holds adapters.safetensors and adapters-optim.safetensors -- megabytes
    where the model is gigabytes -- and the base comes back from the checkpoint the run started from,
    named (with its manifest's sha256) by `base_pointer` in the checkpoint's state."""

    def __init__(self, model: nn.Module):
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: the base's weights are not ours

    @property
    def cfg(self):
        return self.model.cfg

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in self.model.named_parameters(prefix, recurse, remove_duplicate):
            if LORA_TAG in name:
                yield name, p

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters():
            yield p


def base_pointer(start: str) -> dict:
    """{"path", "manifest_sha256"} of the base checkpoint `start` (a folder or a root with `latest`)."""
    path = os.path.abspath(resolve_checkpoint(start))
    return {"path": path, "manifest_sha256": sha256_file(os.path.join(path, MANIFEST))}


def check_base_pointer(saved: dict | None, current: dict | None, where: str) -> None:
    """An adapter-only checkpoint resumes only onto the base it was trained on: the same manifest hash."""
    if saved is None and current is None:
        return
    if saved is None or current is None:
        raise CheckpointError(f"{where}: the checkpoint {'holds no' if saved is None else 'holds'} LoRA adapters "
                              f"on a base and this run {'trains' if current is not None else 'does not train'} "
                              f"LoRA on one: set lora.rank (and reference.from_policy_base) as that run did")
    if saved.get("manifest_sha256") != current["manifest_sha256"]:
        raise CheckpointError(f"{where}: its adapters were trained on the base {saved.get('path')} (manifest sha256 "
                              f"{saved.get('manifest_sha256')}), this run's base {current['path']} has manifest "
                              f"sha256 {current['manifest_sha256']}: point init.checkpoint (or init.sft_dir) at "
                              f"that base")


# ---------------------------------------------------------------------------------------------
# PEFT adapter folders (tools/peft_io.py writes them)


def kltron_name(key: str) -> str:
    m = _PEFT_RE.match(key)
    inv = {hf.split(".")[1]: (sub, attr) for sub, attr, hf in TARGETS.values()}
    if m is None or m.group(3) not in inv:
        raise CheckpointError(f"not a PEFT LoRA key of a Llama-family model: '{key}'")
    sub, attr = inv[m.group(3)]
    return f"layers.{m.group(1)}.{sub}.{attr}.lora.lora_{m.group(4)}"


def kltron_norm_name(key: str) -> str | None:
    """PEFT key of a saved norm -> kltron weight name (base_model.model.model.layers.0.input_layernorm.weight
    -> layers.0.attn_norm.weight); None for any other key."""
    m = _PEFT_NORM_RE.match(key)
    if m is None or (m.group(1) is None) != (m.group(2) == "norm"):
        return None
    return "norm.weight" if m.group(1) is None else f"layers.{m.group(1)}.{PEFT_NORMS[m.group(2)]}.weight"


def read_peft(folder: str) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """(LoRA config, {kltron factor name: full tensor} and {kltron norm weight name: full saved weight}
    in one dict) of a PEFT LoRA adapter folder; norms come from `modules_to_save` (config: train_norms)."""
    cfg_path, w_path = os.path.join(folder, "adapter_config.json"), os.path.join(folder, "adapter_model.safetensors")
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise CheckpointError(f"{folder}: no {os.path.basename(p)} (a PEFT LoRA adapter folder has both)")
    with open(cfg_path) as f:
        c = json.load(f)
    saved = c.get("modules_to_save") or []
    if c.get("peft_type") != "LORA" or c.get("bias", "none") != "none" or isinstance(saved, str) \
            or any(m not in PEFT_NORMS for m in saved):
        raise CheckpointError(f"{cfg_path}: only LoRA adapters convert (peft_type LORA, bias none, modules_to_save "
                              f"among {sorted(PEFT_NORMS)}), found peft_type {c.get('peft_type')!r}, bias "
                              f"{c.get('bias', 'none')!r}, modules_to_save {saved!r}")
    mods = c.get("target_modules") or []
    by_proj = {hf.split(".")[1]: key for key, (_, _, hf) in TARGETS.items()}
    bad = [m for m in mods if m not in by_proj]
    if bad or isinstance(mods, str):
        raise CheckpointError(f"{cfg_path}: target_modules {mods!r}: supported {sorted(by_proj)}")
    lora = LoRAConfig(rank=int(c["r"]), alpha=float(c["lora_alpha"]), rslora=bool(c.get("use_rslora", False)),
                      dropout=float(c.get("lora_dropout", 0.0)), targets=[by_proj[m] for m in mods],
                      train_norms=bool(saved))
    out = {}
    with open_safetensors(w_path) as f:  # the hardened reader: a malformed file is refused by name
        for k in f.keys():
            norm = kltron_norm_name(k)
            if norm is not None and k.split(".")[-2] in saved:  # a norm's full weight (modules_to_save)
                out[norm] = f.get(k)
            else:
                out[kltron_name(k)] = f.get(k)
    return lora, out


def peft_factors(cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """The factors (and saved norm weights) of the PEFT folder `cfg.init_from`, after checking that its rank,
    alpha, rslora and targets are the run's (`lora.*`): the adapters must mean the same function here.
    Saved norms need `lora.train_norms` (else their change would be dropped); a folder without them
    starts the norm deltas at zero."""
    lora, factors = read_peft(cfg.init_from)
    if lora.train_norms and not cfg.train_norms:
        raise CheckpointError(f"lora.init_from={cfg.init_from}: its adapter_config.json saves the norms "
                              f"(modules_to_save), this run does not train them: set lora.train_norms=true")
    for key, got, want in (("rank", lora.rank, cfg.rank), ("alpha", lora.alpha, cfg.alpha),
                           ("rslora", lora.rslora, cfg.rslora), ("targets", sorted(lora.targets), sorted(cfg.targets))):
        if got != want:
            raise CheckpointError(f"lora.init_from={cfg.init_from}: its adapter_config.json gives {key} {got!r}, "
                                  f"this run's lora.{key} is {want!r}: set lora.{key} to match")
    return factors


def adapt_to_checkpoint(model: nn.Module, path: str) -> nn.Module:
    """Attach zero adapters to `model` (a Transformer on a real device, before loading) when the
    model checkpoint at `path` holds LoRA factors (its `lora_config.json`), so that loading it gives
    the adapted model; a checkpoint without them leaves `model` as it is."""
    folder = resolve_checkpoint(path)
    if os.path.isfile(os.path.join(folder, LORA_CONFIG)):
        apply_lora(model, read_lora_config(folder))
    return model
