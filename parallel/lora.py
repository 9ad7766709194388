"""LoRA adapters on the tensor-parallel linears, sharded like the layer they wrap.

y = W x + s * B (A x), s = alpha / r (or alpha / sqrt(r) with `rslora`). The base W is frozen; A
and B are fp32 parameters with their own optimizer state.

| wrapped layer (W local)     | A local                 | B local                  | extra collective          |
|-----------------------------|-------------------------|--------------------------|---------------------------|
| ColumnParallelLinear [o/tp, i] | [r, i] replicated    | [o/tp, r] sharded        | bwd: all-reduce dL/dA [r, i] |
| RowParallelLinear [o, i/tp] | [r, i/tp] sharded       | [o, r] replicated        | bwd: all-reduce dL/dB [o, r] |

Column: x is already the output of the caller's "f" (`copy_to_tp`), so the adapter's partial
dL/dx joins the one all-reduce of dL/dx the base path pays. dL/dA = (B_l^T dy_l) x^T is partial on
each rank (each saw only its output columns): A passes through "f" itself (`tie_replicas`), the
collective the code already uses for a KV head replicated over TP. B_l is a true shard and needs
nothing (unless its KV head is replicated: then the base weight's replica group, as for W).

Row: the adapter's partial output (x_l A_l^T) B^T is linear in the partial x_l A_l^T, so it is
added to the base partial product BEFORE the layer's existing forward all-reduce ("g"): no
forward collective at all (an all-reduce of x_l A_l^T [T, r] before B would be one more latency
per layer per decoding step of every rollout). The price moves to backward: dL/dB = dy (x_l A_l^T)^T
is partial, so B goes through "f" (all-reduce of [o, r] per micro-batch, independent of the token
count). dL/dA_l = B^T dy x_l is already complete (dy is replicated).

Initialisation does not depend on the layout: each full A (and, for tests, B) is drawn from a
generator keyed by (seed, its name), then each rank keeps its TP slice. B starts at zero.
`adapters_disabled(model)` runs the same modules as the base model: the adapters are skipped, not
multiplied by zero, so the base output is bitwise what the unadapted model computes.

Norms (`lora.train_norms`, PEFT's `modules_to_save` of the norms): every RMSNorm (each block's
attn_norm and mlp_norm, the final norm) gets a `NormDelta`, a trainable fp32 vector d (zeros at
init, parameter `<norm>.lora.lora_d`) so that the norm scales by w + d while the adapters are on;
core/model.py's RMSNorm consults it. d is replicated over TP like w: every rank normalises all
hidden columns of the same activations and dL/d(norm output) arrives complete through the next
layer's "f", so dL/dd is complete on each rank with no collective. FSDP shards d with its block.
A merge adds d into w (d <- 0); `adapters_disabled` skips d like the factors.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel.fsdp import full_tensor, local_tensor
from parallel.layers import ColumnParallelLinear, RowParallelLinear, linear, tie_replicas

# target key -> (submodule of a Block, layer attribute, Hugging Face module path below the layer)
TARGETS = {
    "q": ("attn", "wq", "self_attn.q_proj"),
    "k": ("attn", "wk", "self_attn.k_proj"),
    "v": ("attn", "wv", "self_attn.v_proj"),
    "o": ("attn", "wo", "self_attn.o_proj"),
    "gate": ("mlp", "w_gate", "mlp.gate_proj"),
    "up": ("mlp", "w_up", "mlp.up_proj"),
    "down": ("mlp", "w_down", "mlp.down_proj"),
}


@dataclass
class LoRAConfig:
    """The `lora` section. rank 0: off (full fine-tuning)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapter's input only, in training mode
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank
    seed: int = 0  # A's initialisation (keyed further by each adapter's name)
    init_from: str | None = None  # a PEFT adapter folder to start from (rank, alpha, targets must match)
    train_norms: bool = False  # a trainable delta on every RMSNorm weight (NormDelta), beside the adapters

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.train_norms and not self.rank:
            raise ValueError("lora.train_norms=true trains the RMSNorm weights beside the LoRA adapters: it needs "
                             "lora.rank > 0 (with lora.rank=0 the whole model trains, norms included)")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or (self.rank and not self.targets):
            raise ValueError(f"lora.targets: unknown {bad} (choose from {list(TARGETS)})" if bad
                             else "lora.targets is empty")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoRAAdapter(nn.Module):
    """The low-rank branch of one TP linear; `kind` "column" or "row" (see the module docstring)."""

    def __init__(self, kind: str, a_shape, b_shape, scaling: float, dropout: float, tp_group,
                 b_replica_group=None, device=None, dtype=torch.float32):
        super().__init__()
        self.kind, self.scaling, self.dropout = kind, scaling, dropout
        self.tp_group, self.b_replica_group = tp_group, b_replica_group
        self.enabled = True
        self.lora_A = nn.Parameter(torch.zeros(a_shape, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        a, b = self.lora_A, self.lora_B
        if self.kind == "column":
            a = tie_replicas(a, self.tp_group)  # dL/dA is partial per output shard: summed over tp
            b = tie_replicas(b, self.b_replica_group)  # a KV head replicated over TP ranks
        else:
            b = tie_replicas(b, self.tp_group)  # dL/dB formed from the partial x_l A_l^T: summed over tp
        dtype = x.dtype
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(a.dtype)  # fp32 adapters on bf16 activations outside autocast
        # parallel.layers.linear: the batch-invariant form in that mode, like the base's product
        return (linear(linear(x, a), b) * self.scaling).to(dtype)


class NormDelta(nn.Module):
    """d of one RMSNorm (see the module docstring): `forward(w)` is w + d in fp32 or wider."""

    def __init__(self, dim: int, device=None, dtype=torch.float32):
        super().__init__()
        self.enabled = True
        self.lora_d = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(w.dtype, self.lora_d.dtype)
        return w.to(acc) + self.lora_d.to(acc)


def _norms(model) -> list[tuple[str, nn.Module]]:
    """(weight name, RMSNorm) of every norm `lora.train_norms` trains."""
    out = [(f"layers.{i}.{n}.weight", getattr(b, n)) for i, b in enumerate(model.layers)
           for n in ("attn_norm", "mlp_norm")]
    return out + [("norm.weight", model.norm)]


def norm_deltas(model) -> dict[str, NormDelta]:
    """{norm weight name: NormDelta} of a model adapted with `lora.train_norms` (FSDP-wrapped or not)."""
    return {name: norm.lora for name, norm in _norms(model) if getattr(norm, "lora", None) is not None}


def _adapted(model) -> list[tuple[str, str, nn.Module]]:
    """(base weight name, target key, TP linear) for every layer `apply_lora` may adapt."""
    out = []
    for i, block in enumerate(model.layers):
        for key, (sub, attr, _) in TARGETS.items():
            out.append((f"layers.{i}.{sub}.{attr}.weight", key, getattr(getattr(block, sub), attr)))
    return out


def apply_lora(model, cfg: LoRAConfig, device=None):
    """Freeze every parameter of `model` (a `core.model.Transformer`, before `parallelize`) and attach
    zero-filled adapters to the targets; call `init_adapters` (or load them) afterwards."""
    if not cfg.enabled:
        return model
    for p in model.parameters():
        p.requires_grad_(False)
    for _, key, layer in _adapted(model):
        if key not in cfg.targets:
            continue
        out_l, in_l = layer.weight.shape
        dev = layer.weight.device if device is None else device
        # fp32 adapters (own AdamW state) over any base; a float64 base (exactness tests) keeps float64
        kw = dict(device=dev, dtype=torch.float64 if layer.weight.dtype == torch.float64 else torch.float32)
        if isinstance(layer, ColumnParallelLinear):
            layer.lora = LoRAAdapter("column", (cfg.rank, in_l), (out_l, cfg.rank), cfg.scaling, cfg.dropout,
                                     layer.tp_group, layer.replica_group, **kw)
        elif isinstance(layer, RowParallelLinear):
            layer.lora = LoRAAdapter("row", (cfg.rank, in_l), (out_l, cfg.rank), cfg.scaling, cfg.dropout,
                                     layer.tp_group, None, **kw)
    if cfg.train_norms:
        for _, norm in _norms(model):
            dev = norm.weight.device if device is None else device
            norm.lora = NormDelta(norm.weight.shape[0], dev,
                                  torch.float64 if norm.weight.dtype == torch.float64 else torch.float32)
    return model


def adapters(model) -> dict[str, LoRAAdapter]:
    """{base weight name (core/shards): adapter} of an adapted model (FSDP-wrapped or not)."""
    return {name: layer.lora for name, _, layer in _adapted(model) if getattr(layer, "lora", None) is not None}


def has_adapters(model) -> bool:
    return hasattr(model, "layers") and bool(adapters(model))


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model through the same modules: every adapter (and norm delta) skipped inside the block."""
    ads = list(adapters(model).values()) + list(norm_deltas(model).values())
    prev = [a.enabled for a in ads]
    for a in ads:
        a.enabled = False
    try:
        yield model
    finally:
        for a, e in zip(ads, prev):
            a.enabled = e


def lora_delta(ad: LoRAAdapter) -> torch.Tensor:
    """s * B A in fp32 (float64 for float64 factors), the TP-local [out_l, in_l] update the adapter adds
    to W (the factors gathered over dp)."""
    b, a = full_tensor(ad.lora_B), full_tensor(ad.lora_A)
    acc = torch.promote_types(b.dtype, torch.float32)
    return b.to(acc) @ a.to(acc) * ad.scaling


@torch.no_grad()
def merge_adapters(model, reset: bool = True) -> None:
    """W <- W + s B A on every adapted layer (a local update: each rank adds its TP slice; under FSDP
    the delta is gathered over dp, then each rank keeps its own dp shard). `reset`: B <- 0 (A kept),
    so the adapted model computes the same function right after the merge (up to W's rounding).
    Norm deltas: w <- w + d, and d <- 0 with `reset`."""
    for name, ad in adapters(model).items():
        _add_to_param(_layer_of(model, name).weight, lora_delta(ad))
    norms = dict(_norms(model))
    for name, nd in norm_deltas(model).items():
        _add_to_param(norms[name].weight, full_tensor(nd.lora_d))
    if reset:
        for ad in adapters(model).values():
            local_tensor(ad.lora_B).zero_()
        for nd in norm_deltas(model).values():
            local_tensor(nd.lora_d).zero_()


def _layer_of(model, name: str):
    parts = name.split(".")  # layers.{i}.{sub}.{attr}.weight
    return getattr(getattr(model.layers[int(parts[1])], parts[2]), parts[3])


def _add_to_param(p: torch.Tensor, delta: torch.Tensor) -> None:
    if hasattr(p, "device_mesh"):  # an FSDP DTensor: keep this rank's dp shard of the full delta
        from torch.distributed.tensor import DTensor, Replicate

        rep = DTensor.from_local(delta.to(p.device), p.device_mesh, [Replicate()] * len(p.placements),
                                 run_check=False)
        delta = rep.redistribute(p.device_mesh, p.placements).to_local()
    local = local_tensor(p)
    acc = torch.promote_types(local.dtype, delta.dtype)  # add in fp32 (or wider), round into W once
    local.copy_((local.to(acc) + delta.to(device=local.device, dtype=acc)).to(local.dtype))
