"""What a checkpoint records about LoRA adapters (parallel/lora.py), and adapter-only checkpoints.

`lora_config.json` beside the tensors: rank, alpha, rslora, targets, dropout -- what the factors
`<base>.lora.lora_A` / `lora_B` in the safetensors files need to mean a function (tools/peft_io.py
reads it to merge or to write a PEFT folder). It is one of the checkpoint's files, so the manifest
hashes it like the rest.
"""

from __future__ import annotations

import json
import os

import torch.nn as nn

from core.ckpt.atomic import CheckpointError, sha256_file
from core.ckpt.manifest import MANIFEST, resolve_checkpoint
from core.shards import LORA_TAG
from parallel.lora import LoRAConfig

LORA_CONFIG = "lora_config.json"


def write_lora_config(folder: str, cfg: LoRAConfig) -> str:
    """Write `folder/lora_config.json`; returns its path (for `extra_files` of a checkpoint save)."""
    path = os.path.join(folder, LORA_CONFIG)
    with open(path, "w") as f:
        json.dump({"rank": cfg.rank, "alpha": cfg.alpha, "rslora": cfg.rslora, "targets": list(cfg.targets),
                   "dropout": cfg.dropout}, f, indent=1)
    return path


def read_lora_config(ckpt: str) -> LoRAConfig:
    path = os.path.join(ckpt, LORA_CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt}: holds LoRA factors but no {LORA_CONFIG} (rank, alpha, targets)")
    try:
        with open(path) as f:
            d = json.load(f)
        return LoRAConfig(rank=int(d["rank"]), alpha=float(d["alpha"]), rslora=bool(d.get("rslora", False)),
                          targets=list(d["targets"]), dropout=float(d.get("dropout", 0.0)))
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
