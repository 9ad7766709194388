"""Layout-independent initialisation of the LoRA adapters of parallel/lora.py.

Each full factor is drawn from a generator keyed by (seed, its name), as core/model.py draws the
base weights, then each rank keeps its TP slice (core/shards.py's LoRA section): every tp x dp
layout starts from the same adapters.
"""

from __future__ import annotations

import math
import zlib

import torch

from core.shards import lora_full_shape, lora_local
from parallel.comm import group_rank, group_size
from parallel.dims import derive_seed
from parallel.lora import adapters, norm_deltas


@torch.no_grad()
def init_adapters(model, seed: int, b_std: float = 0.0) -> None:
    """A ~ N(0, 1/in_features); B = 0 (the adapted model starts as its base), or N(0, b_std^2) likewise
    keyed (tests: a B that is not zero makes the first step move A too)."""
    tp, rank = group_size(model.tp_group), group_rank(model.tp_group)
    for name, ad in adapters(model).items():
        stem = name[:-len(".weight")]
        for which, p in (("A", ad.lora_A), ("B", ad.lora_B)):
            factor = f"{stem}.lora.lora_{which}"
            shape = lora_full_shape(factor, model.cfg, ad.lora_A.shape[0])
            std = 1.0 / math.sqrt(shape[1]) if which == "A" else b_std
            if std == 0.0:
                p.zero_()
                continue
            g = torch.Generator().manual_seed(derive_seed(seed, zlib.crc32(factor.encode())))
            full = torch.randn(shape, generator=g, dtype=torch.float64, device="cpu") * std
            p.copy_(lora_local(full, factor, model.cfg, rank, tp).to(device=p.device, dtype=p.dtype))


@torch.no_grad()
def load_adapter_factors(model, factors: dict, where: str) -> None:
    """Fill every adapter of `model` (before FSDP) from {factor name: full tensor} (e.g. a PEFT folder
    read by core/ckpt/adapters.read_peft): each rank copies its TP slice. A missing, extra or
    misshapen factor is refused, naming `where` and the factor. {norm weight name: full saved weight}
    entries (PEFT's modules_to_save) set that norm's delta d = w_saved - w_base (`lora.train_norms`;
    the norms not named keep d = 0)."""
    tp, rank = group_size(model.tp_group), group_rank(model.tp_group)
    factors = dict(factors)
    deltas = norm_deltas(model)
    for name in [n for n in factors if ".lora.lora_" not in n]:
        saved = factors.pop(name)
        if name not in deltas:
            raise ValueError(f"{where}: '{name}' (a saved norm) has no norm delta here: set lora.train_norms=true"
                             if name.endswith("norm.weight") else f"{where}: '{name}' is not a LoRA factor")
        w, d = _norm_weight(model, name), deltas[name].lora_d
        if tuple(saved.shape) != tuple(w.shape):
            raise ValueError(f"{where}: norm '{name}' has shape {list(saved.shape)}, the model's is {list(w.shape)}")
        acc = torch.promote_types(d.dtype, torch.float32)
        d.copy_((saved.to(device=w.device, dtype=acc) - w.to(acc)).to(d.dtype))
    want = {}
    for name, ad in adapters(model).items():
        stem = name[:-len(".weight")]
        for which, p in (("A", ad.lora_A), ("B", ad.lora_B)):
            want[f"{stem}.lora.lora_{which}"] = p
    extra = sorted(set(factors) - set(want))
    missing = sorted(set(want) - set(factors))
    if extra or missing:
        raise ValueError(f"{where}: " + (f"factor '{missing[0]}' missing" if missing else
                                         f"factor '{extra[0]}' has no adapter here (lora.targets)"))
    for key, p in want.items():
        shape = lora_full_shape(key, model.cfg, p.shape[0] if key.endswith("A") else p.shape[1])
        full = factors[key]
        if tuple(full.shape) != tuple(shape):
            raise ValueError(f"{where}: factor '{key}' has shape {list(full.shape)}, lora.rank and the model "
                             f"give {list(shape)}")
        p.copy_(lora_local(full, key, model.cfg, rank, tp).to(device=p.device, dtype=p.dtype))


def _norm_weight(model, name: str) -> torch.Tensor:
    """The base weight of norm `name` (layers.{i}.attn_norm.weight, layers.{i}.mlp_norm.weight, norm.weight)."""
    parts = name.split(".")
    return (model.norm if parts[0] == "norm" else getattr(model.layers[int(parts[1])], parts[2])).weight
