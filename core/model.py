"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral) with explicit tensor parallelism.

Shapes use B batch, S query length, L key length (cache + S), H hidden, hd head dim, nh/nkv the
model's heads, and the local counts nh_l = nh/tp, nkv_l = max(nkv/tp, 1) on each TP rank.
Activations between blocks are replicated over the TP group (`sequence_parallel`: split on S, core/
seq_parallel.py); heads and MLP columns are sharded; logits on the padded vocabulary. Shards: core/shards.py.

The same seed gives the same full model for every layout: each parameter's full tensor is drawn
from a generator keyed by (seed, name), then each rank keeps its slice.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.causal_layout import (  # the mask helpers live there; imported from here too
    attention_mask_4d,
    check_packed,
    document_mask_4d,
    document_positions,
    left_pad_shift,
    roll_rows,
    single_piece_rows,
)
from core.config import ModelConfig
from core.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: F401 - rope_inv_freq: imported from here too
from core.seq_parallel import pad_to_multiple, sp_active
from core.shards import full_param_shapes, kv_heads_per_rank, local_shard
from parallel.comm import gather_from_tp, group_rank, group_size
from parallel.context import ContextAttention
from parallel.dims import derive_seed
from parallel.invariant import (
    CachePositions,
    CanonicalLayout,
    batch_invariant,
    invariant_attend,
    invariant_layout,
    silu,
)
from parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel,
    vocab_parallel_logits,
)
from parallel.seq_comm import reduce_grad_over_tp

# ---------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None, tp_group=None):
        super().__init__()
        self.eps, self.tp_group = eps, tp_group
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.lora = None  # a parallel.lora.NormDelta (lora.train_norms): the weight is w + d while it is on

    def forward(self, x: torch.Tensor, seq_parallel: bool = False) -> torch.Tensor:
        # statistics in fp32 or wider (fp64 stays fp64: a float64 check of gradients summed over rows that
        # share activations, rl/update/shared_layout.py, would otherwise see fp32 rounding of each backward)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        lora = self.lora is not None and self.lora.enabled  # lora.train_norms: the weight is w + d
        w = self.lora(self.weight) if lora else self.weight
        w = reduce_grad_over_tp(w, self.tp_group) if seq_parallel else w  # SP: grad (of w, or of d) summed over tp
        out = w * xf.to(x.dtype)
        return out.to(torch.promote_types(self.weight.dtype, x.dtype)) if lora else out


@dataclass
class KVCache:
    """Per-layer keys and values [B, nkv_l, max_len, hd] for incremental decoding."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, tp: int, device, dtype) -> KVCache:
        shape = (batch, kv_heads_per_rank(cfg, tp), max_len, cfg.head_dim)
        return cls([torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)],
                   [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)])

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` [b] (indices), e.g. when finished sequences leave the batch.
        One layer at a time, each old tensor dropped as its copy is made: the copy costs one layer's
        [b, nkv_l, max_len, hd], not a second cache."""
        for store in (self.k, self.v):
            for i in range(len(store)):
                store[i] = store[i].index_select(0, rows)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group, kv_replica_group, device=None, dtype=None):
        super().__init__()
        tp = group_size(tp_group)
        self.hd, self.nh_l, self.nkv_l = cfg.head_dim, cfg.n_heads // tp, kv_heads_per_rank(cfg, tp)
        H, b = cfg.hidden_size, cfg.qkv_bias
        self.tp_group = tp_group
        kw = dict(device=device, dtype=dtype, copy_input=False)  # forward() copies x to tp once for q, k, v
        self.wq = ColumnParallelLinear(H, self.nh_l * self.hd, tp_group, bias=b, **kw)
        self.wk = ColumnParallelLinear(H, self.nkv_l * self.hd, tp_group, bias=b, replica_group=kv_replica_group, **kw)
        self.wv = ColumnParallelLinear(H, self.nkv_l * self.hd, tp_group, bias=b, replica_group=kv_replica_group, **kw)
        self.wo = RowParallelLinear(self.nh_l * self.hd, H, tp_group, device=device, dtype=dtype)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int, sp: bool = False):
        # f once for q, k, v: one all-reduce of dL/dx (SP: gather S, reduce-scatter dL/dx; parallel/layers.py)
        q, k, v = column_parallel(x, (self.wq, self.wk, self.wv), self.tp_group, sp)
        B, S = q.shape[:2]
        q = q.view(B, S, self.nh_l, self.hd).transpose(1, 2)  # (B, nh_l, S, hd)
        k = k.view(B, S, self.nkv_l, self.hd).transpose(1, 2)  # (B, nkv_l, S, hd)
        v = v.view(B, S, self.nkv_l, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None and isinstance(mask, CachePositions):  # each key at its position
            k, v = mask.write(cache.k[layer], cache.v[layer], k, v)
        elif cache is not None:
            start = cache.length
            cache.k[layer][:, :, start:start + S] = k
            cache.v[layer][:, :, start:start + S] = v
            k = cache.k[layer][:, :, :start + S]  # (B, nkv_l, L, hd)
            v = cache.v[layer][:, :, :start + S]
        gqa = self.nh_l != self.nkv_l
        if isinstance(mask, ContextAttention):  # context parallel: this rank's tokens against the whole sequence
            y = mask.attend(q, k, v)
        elif isinstance(mask, (CanonicalLayout, CachePositions)):
            y = invariant_attend(mask, q, k, v)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, S, self.nh_l * self.hd), sp)  # (B, S or S/tp, H)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group, device=None, dtype=None):
        super().__init__()
        tp, H = group_size(tp_group), cfg.hidden_size
        self.tp_group = tp_group
        kw = dict(device=device, dtype=dtype, copy_input=False)  # forward() copies x to tp once for gate, up
        self.w_gate = ColumnParallelLinear(H, cfg.intermediate_size // tp, tp_group, **kw)
        self.w_up = ColumnParallelLinear(H, cfg.intermediate_size // tp, tp_group, **kw)
        self.w_down = RowParallelLinear(cfg.intermediate_size // tp, H, tp_group, device=device, dtype=dtype)

    def forward(self, x, sp: bool = False):
        gate_up = column_parallel(x, (self.w_gate, self.w_up), self.tp_group, sp)  # f once, as Attention's
        return self.w_down(silu(gate_up.pop(0)) * gate_up.pop(0), sp)  # no name keeps gate alive past silu


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group, kv_replica_group, device=None, dtype=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device, dtype, tp_group)
        self.attn = Attention(cfg, tp_group, kv_replica_group, device, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device, dtype, tp_group)
        self.mlp = MLP(cfg, tp_group, device, dtype)

    def forward(self, x, cos, sin, mask=None, cache=None, layer=0, sp=False):
        x = x + self.attn(self.attn_norm(x, sp), cos, sin, mask, cache, layer, sp)
        return x + self.mlp(self.mlp_norm(x, sp), sp)


# ---------------------------------------------------------------------------------------------
# the model


class Transformer(nn.Module):
    """Decoder LM. `tp_group` shards it; `kv_replica_group` (tp > n_kv_heads only) groups the
    ranks that share a KV head. `device="meta"` builds it without memory (for checkpoint loads).
    `with_lm_head=False` drops an untied LM head (a critic's body)."""

    def __init__(self, cfg: ModelConfig, tp_group=None, kv_replica_group=None, device=None,
                 dtype=torch.float32, with_lm_head: bool = True):
        super().__init__()
        cfg.validate()
        self.cfg, self.tp_group = cfg, tp_group
        self.tp, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        if cfg.n_heads % self.tp or cfg.intermediate_size % self.tp:
            raise ValueError(f"tp={self.tp} must divide n_heads={cfg.n_heads} and "
                             f"intermediate_size={cfg.intermediate_size}")
        self.padded_vocab = cfg.padded_vocab_size(self.tp)
        self.embed = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, tp_group, device, dtype)
        self.layers = nn.ModuleList(Block(cfg, tp_group, kv_replica_group, device, dtype)
                                    for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device, dtype, tp_group)
        self.with_lm_head = with_lm_head
        if with_lm_head and not cfg.tie_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = nn.Parameter(torch.empty(self.padded_vocab // self.tp, cfg.hidden_size,
                                                           device=device, dtype=dtype))
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device=None if device == "meta" else device),
                             persistent=False)
        self.compute_dtype: torch.dtype | None = None  # None: compute in the weights' dtype (no autocast)
        self._compiled_layers: list | None = None  # torch.compile'd blocks (a plain list: not submodules)
        # parallel.batch_invariant: each token's bits independent of the batch (parallel/invariant.py)
        self.batch_invariant = False
        self.sequence_parallel = False  # parallel.sequence_parallel (core/seq_parallel.py)

    # -----------------------------------------------------------------------------------------
    # precision and compilation

    def set_mixed_precision(self, mode: str) -> Transformer:
        """mode "bf16": the forward runs under `torch.autocast(<device>, bfloat16)` over the weights
        as they are (fp32 master weights stay fp32, so do their gradients and every gradient
        reduction); rotary tables, attention and the KV cache of `generate` are bf16, the RMSNorm
        statistics and the fused heads' logits fp32. "fp32": no autocast. Under FSDP2 with
        bf16 params the weights are already bf16 inside forward and the autocast is a no-op."""
        if mode not in ("fp32", "bf16"):
            raise ValueError(f"mixed precision must be 'fp32' or 'bf16', got {mode!r}")
        self.compute_dtype = torch.bfloat16 if mode == "bf16" else None
        return self

    def cast_weights(self, dtype: torch.dtype) -> Transformer:
        """Store the parameters in `dtype` (e.g. a bf16 reference); the rotary inverse frequencies
        stay fp32 (in bf16 the angle position * inv_freq would be off by radians at long positions)."""
        inv_freq = self.inv_freq
        self.to(dtype)
        self.inv_freq = inv_freq
        return self

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of attention inputs and of the KV cache: the compute dtype, else the weights'."""
        return self.compute_dtype or self.embed.weight.dtype

    def _autocast(self, device: torch.device):
        if self.compute_dtype is None or device.type not in ("cuda", "cpu"):
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def compile_blocks(self, **compile_kwargs) -> Transformer:
        """torch.compile each transformer block (call after activation checkpointing and FSDP, so
        the compiled block includes them). Used for full-sequence forwards (training, log-probs);
        KV-cache decoding keeps the eager blocks (its cache length changes every step)."""
        self._compiled_layers = [torch.compile(b, **compile_kwargs) for b in self.layers]
        return self

    @property
    def head_weight(self) -> torch.Tensor:
        """The local LM-head weight [Vp/tp, H] (the embedding table when tied)."""
        return self.embed.weight if self.cfg.tie_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, *, position_ids=None, attention_mask=None,
                kv_cache: KVCache | None = None, head=None, document_ids=None, prefix_ids=None, context=None):
        """input_ids [B, S] -> logits_local [B, S, Vp/tp] (sharded on the vocabulary).

        attention_mask [B, L] marks real tokens (L = cache length + S; needed with padding).
        `head(hidden, weight_local)` replaces the plain logits: it receives the final hidden states
        [B, S, H] (replicated over tp) and the local head weight [Vp/tp, H] (None without an LM
        head), and its result is returned -- e.g. the fused log-prob/entropy/KL head, or a value
        head. A vocab-parallel head must pass `hidden` through `parallel.comm.copy_to_tp` first
        (so dL/dhidden is summed over the vocabulary shards); a replicated head must not.
        Running it inside forward keeps FSDP2's gather of the head weight around the call.
        With `sequence_parallel` the head still gets all S positions (gathered, backward a slice).

        document_ids [B, S] (packed sequences; no kv_cache, no attention_mask): several documents per
        row, each a contiguous run of one id; attention is block-diagonal causal (no token sees
        another document) and positions restart at 0 per document unless `position_ids` are given.
        prefix_ids [B, S] (shared prompts, with document_ids and position_ids): a token also sees the
        earlier tokens of document prefix_ids (its group's prompt; `document_mask_4d`).
        context (`parallel.context.ContextParallel`): every [B, S/cp] input is this rank's tokens (position_ids
        required; padding as documents, no kv_cache); attention sees the whole sequence (parallel/context.py).
        """
        if context is not None:
            if kv_cache is not None or attention_mask is not None or position_ids is None or self.batch_invariant:
                raise ValueError("Transformer.forward under context parallelism takes position_ids, no kv_cache, "
                                 "no attention_mask (padding as document_ids), no batch_invariant")
            S_l, sp = input_ids.shape[1], sp_active(self, None)
            if sp and S_l % self.tp:  # each rank's tokens split over tp: ContextParallel(multiple=tp) pads for it
                raise ValueError(f"sequence parallelism under context parallelism: this rank's {S_l} tokens are not "
                                 f"a multiple of tp={self.tp} (build ContextParallel with multiple=tp)")
            return self._forward_tokens(input_ids, position_ids, context.attention(S_l, document_ids, prefix_ids),
                                        None, None, head, sp, S_l)
        with batch_invariant(self.batch_invariant):
            return self._forward(input_ids, position_ids, attention_mask, kv_cache, head, document_ids, prefix_ids)

    def _forward(self, input_ids, position_ids, attention_mask, kv_cache, head, document_ids, prefix_ids):
        B, S = input_ids.shape
        past = kv_cache.length if kv_cache is not None else 0
        check_packed(input_ids, document_ids, attention_mask, kv_cache, prefix_ids, position_ids)
        if document_ids is not None:  # packed: positions restart per document
            position_ids = document_positions(document_ids) if position_ids is None else position_ids
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:past + S]
            else:
                position_ids = torch.arange(past, past + S, device=input_ids.device).expand(B, S)
        sp, S_in = sp_active(self, kv_cache), S
        if sp:  # S padded at the end to a multiple of tp (core/seq_parallel.py)
            S, input_ids, position_ids, attention_mask, document_ids, prefix_ids = pad_to_multiple(
                self.tp, input_ids, position_ids, attention_mask, document_ids, prefix_ids)
        mask, shift = None, None
        # the causal-layout checks read values (a host sync); meta has none; the invariant layouts need none
        real = input_ids.device.type != "meta" and not self.batch_invariant
        if real and attention_mask is not None and kv_cache is None and S > 1:  # causal in disguise: causal_layout
            shift = left_pad_shift(attention_mask)
        if attention_mask is not None and shift is None:
            mask = attention_mask_4d(attention_mask, S)
        elif kv_cache is not None and past > 0:
            mask = attention_mask_4d(torch.ones(B, past + S, dtype=torch.bool, device=input_ids.device), S)
        if document_ids is not None and not (real and single_piece_rows(
                document_ids, prefix_ids if prefix_ids is not None else document_ids)):
            mask = document_mask_4d(document_ids, prefix_ids)  # packed: block-diagonal causal attention
        if self.batch_invariant:  # every token's keys laid out at their positions (parallel/invariant.py)
            mask = invariant_layout(input_ids, position_ids, attention_mask, past if kv_cache is not None else None,
                                    document_ids, prefix_ids)
        if shift is not None and not bool(shift.any()):
            shift = None  # no leading padding: the mask is causal as the rows stand
        if shift is not None:  # each row's real tokens from position 0: causal attention is the mask
            input_ids, position_ids = roll_rows(input_ids, shift), roll_rows(position_ids, shift)
        return self._forward_tokens(input_ids, position_ids, mask, shift, kv_cache, head, sp, S_in)

    def _forward_tokens(self, input_ids, position_ids, mask, shift, kv_cache, head, sp: bool, S_in: int):
        past, S = (kv_cache.length if kv_cache is not None else 0), input_ids.shape[1]
        with self._autocast(input_ids.device):
            x = self.embed(input_ids, sp)  # (B, S, H), replicated over tp; sequence-parallel (B, S/tp, H)
            cos, sin = rope_cos_sin(self.inv_freq, position_ids, self.compute_dtype or x.dtype)
            compiled = self._compiled_layers and kv_cache is None and not self.batch_invariant
            layers = self._compiled_layers if compiled else self.layers
            for i, block in enumerate(layers):
                x = block(x, cos, sin, mask, kv_cache, i, sp)
            x = self.norm(x, sp)  # per token: commutes with the roll below
            x = gather_from_tp(x, self.tp_group, dim=1) if sp else x  # SP: all S to the head; bwd a slice
            if shift is not None:
                x = roll_rows(x, shift, inverse=True)
            x = x[:, :S_in]
            if kv_cache is not None:
                kv_cache.length = past + S
            w = self.head_weight if self.with_lm_head else None
            if self.compute_dtype is not None:  # the head's matmul operands in the compute dtype
                x = x.to(self.compute_dtype)
                w = None if w is None else w.to(self.compute_dtype)
            if head is None:
                return vocab_parallel_logits(x, w, self.tp_group)
            return head(x, w)

    # -----------------------------------------------------------------------------------------
    # initialisation independent of the layout

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Draw every full tensor from a generator keyed by (seed, name); keep this rank's slice."""
        cfg = self.cfg
        params = dict(self.named_parameters())
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, shape in full_param_shapes(cfg).items():
            if name not in params:  # no LM head on a critic's body
                continue
            p = params[name]
            leaf = name.split(".")[-2]
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name.endswith(".bias"):
                p.zero_()
                continue
            g = torch.Generator().manual_seed(derive_seed(seed, zlib.crc32(name.encode())))
            std = resid_std if leaf in ("wo", "w_down") else cfg.init_std
            full = torch.randn(shape, generator=g, dtype=torch.float32, device="cpu") * std
            p.copy_(local_shard(full, name, cfg, self.tp_rank, self.tp).to(p.dtype))
        self.inv_freq = rope_inv_freq(cfg).to(self.embed.weight.device)


def build_model(cfg: ModelConfig, tp_group=None, kv_replica_group=None, seed: int | None = 0,
                device=None, dtype=torch.float32) -> Transformer:
    """A model with this rank's shards; initialised from `seed`, or left empty on `device="meta"`."""
    model = Transformer(cfg, tp_group, kv_replica_group, device=device, dtype=dtype)
    if seed is not None and str(device) != "meta":
        model.init_weights(seed)
    return model
