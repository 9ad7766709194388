"""What a checkpoint records about LoRA adapters (parallel/lora.py).

`lora_config.json` beside the tensors: rank, alpha, rslora, targets, dropout -- what the factors
`<base>.lora.lora_A` / `lora_B` in the safetensors files need to mean a function (tools/peft_io.py
reads it to merge or to write a PEFT folder). It is one of the checkpoint's files, so the manifest
hashes it like the rest.
"""

from __future__ import annotations

import json
import os

from core.ckpt.atomic import CheckpointError
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
