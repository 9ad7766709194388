"""Where each parameter's tensor-parallel shard comes from in the full (checkpoint) tensor.

Full tensors are layout independent: the true vocabulary (no padding) and the model's own number
of KV heads. A rank's local tensor is `full.narrow(dim, start, stop - start)` followed by
`local_size - (stop - start)` zero rows along `dim` (vocabulary padding only). When tp exceeds
the number of KV heads, every group of tp // n_kv_heads ranks holds the same KV head (replicated).

| name                         | full shape              | local shape                    | dim |
|------------------------------|-------------------------|--------------------------------|-----|
| embed.weight                 | [V, H]                  | [Vp/tp, H]                     | 0   |
| layers.i.attn.wq.weight      | [nh*hd, H]              | [nh/tp*hd, H]                  | 0   |
| layers.i.attn.wk/wv.weight   | [nkv*hd, H]             | [max(nkv/tp,1)*hd, H]          | 0   |
| layers.i.attn.wq/wk/wv.bias  | [n*hd]                  | as the weight's rows           | 0   |
| layers.i.attn.wo.weight      | [H, nh*hd]              | [H, nh/tp*hd]                  | 1   |
| layers.i.mlp.w_gate/w_up     | [I, H]                  | [I/tp, H]                      | 0   |
| layers.i.mlp.w_down.weight   | [H, I]                  | [H, I/tp]                      | 1   |
| lm_head.weight (untied only) | [V, H]                  | [Vp/tp, H]                     | 0   |
| *norm.weight                 | [H]                     | [H]                            | -   |
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from core.config import ModelConfig


class TPSlice(NamedTuple):
    dim: int | None  # None: replicated on every TP rank
    start: int = 0
    stop: int = 0
    local_size: int = 0  # >= stop - start; the rest is zero padding

    @property
    def pad(self) -> int:
        return self.local_size - (self.stop - self.start)


def full_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and layout-independent shape, in model order."""
    H, hd, I, V = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, H)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (H,)
        shapes[p + "attn.wq.weight"] = (cfg.n_heads * hd, H)
        shapes[p + "attn.wk.weight"] = (cfg.n_kv_heads * hd, H)
        shapes[p + "attn.wv.weight"] = (cfg.n_kv_heads * hd, H)
        if cfg.qkv_bias:
            shapes[p + "attn.wq.bias"] = (cfg.n_heads * hd,)
            shapes[p + "attn.wk.bias"] = (cfg.n_kv_heads * hd,)
            shapes[p + "attn.wv.bias"] = (cfg.n_kv_heads * hd,)
        shapes[p + "attn.wo.weight"] = (H, cfg.n_heads * hd)
        shapes[p + "mlp_norm.weight"] = (H,)
        shapes[p + "mlp.w_gate.weight"] = (I, H)
        shapes[p + "mlp.w_up.weight"] = (I, H)
        shapes[p + "mlp.w_down.weight"] = (H, I)
    shapes["norm.weight"] = (H,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    return max(cfg.n_kv_heads // tp, 1)


def tp_slice(name: str, cfg: ModelConfig, tp_rank: int, tp: int) -> TPSlice:
    """The rows (or columns) of the full tensor `name` that TP rank `tp_rank` of `tp` holds."""
    if LORA_TAG in name:
        return lora_tp_slice(name, cfg, tp_rank, tp)
    shape = full_param_shapes(cfg).get(name)
    if shape is None:
        raise KeyError(f"unknown parameter '{name}'")
    leaf = name.split(".")[-2] if "." in name else name
    if name in ("embed.weight", "lm_head.weight"):
        width = cfg.padded_vocab_size(tp) // tp
        start = min(tp_rank * width, cfg.vocab_size)
        stop = min(start + width, cfg.vocab_size)
        return TPSlice(0, start, stop, width)
    if leaf in ("wk", "wv"):
        hd = cfg.head_dim
        if tp <= cfg.n_kv_heads:
            n = cfg.n_kv_heads // tp
            return TPSlice(0, tp_rank * n * hd, (tp_rank + 1) * n * hd, n * hd)
        head = tp_rank // (tp // cfg.n_kv_heads)  # replicated: tp // n_kv ranks share a head
        return TPSlice(0, head * hd, (head + 1) * hd, hd)
    if leaf in ("wq", "w_gate", "w_up"):
        n = shape[0] // tp
        return TPSlice(0, tp_rank * n, (tp_rank + 1) * n, n)
    if leaf in ("wo", "w_down"):
        n = shape[1] // tp
        return TPSlice(1, tp_rank * n, (tp_rank + 1) * n, n)
    return TPSlice(None, 0, shape[0], shape[0])


def tp_replicas(name: str, cfg: ModelConfig, tp: int) -> int:
    """How many TP ranks hold identical copies of `name`'s local tensor (1 when truly sharded).
    Used to count each value once in a global gradient norm.

    A model wrapped as the `.body` of another module (a critic) has its names prefixed "body.";
    parameters outside the model's own names (such a wrapper's small head) must be replicated
    over TP, so they count tp times."""
    name = name[len("body."):] if name.startswith("body.") else name
    if LORA_TAG in name:
        return lora_tp_replicas(name, cfg, tp)
    if name not in full_param_shapes(cfg):
        return tp
    sl = tp_slice(name, cfg, 0, tp)
    if sl.dim is None:
        return tp
    leaf = name.split(".")[-2]
    if leaf in ("wk", "wv") and tp > cfg.n_kv_heads:
        return tp // cfg.n_kv_heads
    return 1


# ---------------------------------------------------------------------------------------------
# LoRA factors (parallel/lora.py): "<base>.lora.lora_A" [r, in] and "<base>.lora.lora_B" [out, r] of the
# base weight "<base>.weight". A column-parallel base (wq, wk, wv, w_gate, w_up) shards B's rows like
# its own and replicates A; a row-parallel base (wo, w_down) shards A's columns and replicates B.
# A norm's delta "<norm>.lora.lora_d" [H] (lora.train_norms) is replicated over TP like the norm.

LORA_TAG = ".lora.lora_"


def lora_factor(name: str) -> tuple[str, str, bool]:
    """(base weight name, "A" or "B", whether the base is row-parallel) of a factor's name."""
    base, which = name.split(LORA_TAG)
    return base + ".weight", which, base.split(".")[-1] in ("wo", "w_down")


def lora_tp_slice(name: str, cfg: ModelConfig, tp_rank: int, tp: int) -> TPSlice:
    base, which, row = lora_factor(name)
    if (which == "A") != row:  # column A, row B: replicated
        return TPSlice(None)
    return tp_slice(base, cfg, tp_rank, tp)


def lora_tp_replicas(name: str, cfg: ModelConfig, tp: int) -> int:
    base, which, row = lora_factor(name)
    if (which == "A") != row:
        return tp
    return 1 if row else tp_replicas(base, cfg, tp)  # a column B: like its base's rows (KV heads)


def lora_full_shape(name: str, cfg: ModelConfig, rank: int) -> tuple[int, int]:
    """The unsharded shape of factor `name` for adapters of rank `rank`."""
    base, which, _ = lora_factor(name)
    if which == "d":
        return tuple(full_param_shapes(cfg)[base])
    out, inp = full_param_shapes(cfg)[base]
    return (rank, inp) if which == "A" else (out, rank)


def lora_local(full, name: str, cfg: ModelConfig, tp_rank: int, tp: int):
    """This rank's TP-local tensor of the full factor `full`."""
    sl = lora_tp_slice(name, cfg, tp_rank, tp)
    if sl.dim is None:
        return full.clone()
    return full.narrow(sl.dim, sl.start, sl.stop - sl.start).contiguous()


def local_shard(full: torch.Tensor, name: str, cfg: ModelConfig, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's local tensor from the full tensor: the slice of core/shards, zero-padded."""
    sl = tp_slice(name, cfg, tp_rank, tp)
    if sl.dim is None:
        return full.clone()
    part = full.narrow(sl.dim, sl.start, sl.stop - sl.start)
    if sl.pad:
        pad_shape = list(part.shape)
        pad_shape[sl.dim] = sl.pad
        part = torch.cat([part, part.new_zeros(pad_shape)], dim=sl.dim)
    return part.contiguous()
