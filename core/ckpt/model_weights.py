"""Model weights in and out of kltron checkpoint folders, at any tp and dp, one tensor at a time.

On disk every tensor is FULL and layout independent (core/shards). In memory a parameter is

| module state                 | parameter                    | this rank holds                          |
|------------------------------|------------------------------|------------------------------------------|
| built, not FSDP-wrapped      | plain tensor                 | its TP-local tensor (core/shards slice)  |
| FSDP2-wrapped over dp        | DTensor, Shard(0) on dp mesh | dim-0 chunk (torch.chunk) of TP-local    |

Loading: each rank reads only its TP slice of each tensor straight from the file (lazy, memory
mapped), keeps its FSDP chunk if the parameter is sharded, and copies it in: no rank ever holds
the whole model. Saving: one parameter at a time, all-gather the FSDP shards over dp (the
TP-local tensor), all-gather over tp on dp rank 0 and drop padding / replicated KV rows
(`assemble_full`); global rank 0 streams each full tensor to the file and frees it.

Parameter names: a module's own names, minus wrapper tags. Names that core/shards knows (after a
leading "body.", as in a Critic) are TP-sliced as it says; any other (a Critic's "value_head.*")
is replicated over tp and its full shape is its TP-local shape.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from core.ckpt.atomic import CheckpointError, raise_on_all_ranks
from core.ckpt.checks import check_config, check_tokenizer
from core.ckpt.commit import save_checkpoint_at
from core.ckpt.manifest import open_checkpoint, tensor_files, verify_files
from core.ckpt.safetensors_write import StreamingWriter, stream_order
from core.ckpt.tensors import assemble_full, iter_tensors
from core.config import ModelConfig, to_dict
from core.model import Transformer, rope_inv_freq
from core.shards import LORA_TAG, TPSlice, full_param_shapes, lora_full_shape, tp_slice
from parallel.comm import all_gather_along, group_rank, group_size
from parallel.fsdp import full_tensor, is_dtensor

# fields that change neither the function nor the stored tensors
LAYOUT_ONLY_FIELDS = ("init_std", "vocab_pad_multiple")
ARCH_FIELDS = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "head_dim",
               "rope_theta", "rope_scaling", "norm_eps", "qkv_bias", "tie_embeddings")
_WRAPPER_TAGS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def world_group(state):
    """Every rank taking part: None for a single process (state None or without a mesh); the state's
    role group in a launch split into roles (parallel/roles.py), else the world."""
    if state is None or getattr(state, "mesh", None) is None:
        return None
    return getattr(state, "group", None) or dist.group.WORLD


# ---------------------------------------------------------------------------------------------
# which tensor is which


class ParamSpec(NamedTuple):
    name: str  # the module's parameter name (the key in the file)
    model_name: str | None  # core/shards name when TP-sliced by its table; None: replicated over tp
    full_shape: tuple[int, ...]  # layout independent
    param: nn.Parameter

    def slice(self, cfg: ModelConfig, tp_rank: int, tp: int) -> TPSlice:
        if self.model_name is None:
            return TPSlice(None, 0, 0, 0)
        return tp_slice(self.model_name, cfg, tp_rank, tp)


def clean_name(name: str) -> str:
    for tag in _WRAPPER_TAGS:
        name = name.replace(tag, "")
    return name


def param_specs(module: nn.Module, cfg: ModelConfig, tp: int) -> list[ParamSpec]:
    """Every parameter of `module` with its file key and full shape; checks the TP-local shapes
    (a DTensor's `.shape` is the TP-local shape, gathered over dp) against core/shards."""
    shapes = full_param_shapes(cfg)
    out = []
    for name, p in module.named_parameters():
        name = clean_name(name)
        model_name = name.removeprefix("body.")
        if LORA_TAG in model_name:  # a LoRA factor (parallel/lora.py): sliced like its base weight
            rank = p.shape[0] if model_name.endswith("lora_A") else p.shape[-1]  # (a norm's d: unused)
            shapes = {**shapes, model_name: lora_full_shape(model_name, cfg, rank)}
        if model_name not in shapes:
            out.append(ParamSpec(name, None, tuple(p.shape), p))
            continue
        full = shapes[model_name]
        sl = tp_slice(model_name, cfg, 0, tp)
        local = list(full)
        if sl.dim is not None:
            local[sl.dim] = sl.local_size
        if tuple(p.shape) != tuple(local):
            raise CheckpointError(f"parameter '{name}' has TP-local shape {list(p.shape)}, but tp={tp} gives "
                                  f"{local}: the model was built for another tp or config")
        out.append(ParamSpec(name, model_name, full, p))
    return out


def tp_info(state) -> tuple[object, int, int]:
    """(tp group, tp size, tp rank) of `state`; (None, 1, 0) for a single process."""
    g = None if state is None else state.tp_group
    return g, group_size(g), group_rank(g)


def _dp_rank(state) -> int:
    return 0 if state is None else state.dp_rank


# ---------------------------------------------------------------------------------------------
# into and out of a (possibly FSDP-sharded) parameter


@torch.no_grad()
def copy_into(dst: torch.Tensor, tp_local: torch.Tensor) -> None:
    """Copy the TP-local tensor `tp_local` into `dst`: a plain tensor of the same shape, or an
    FSDP DTensor whose local piece is this rank's chunk of it (no communication)."""
    if is_dtensor(dst):
        from torch.distributed.tensor import distribute_tensor

        src = tp_local.to(device=dst.device, dtype=dst.dtype)
        # src_data_rank=None: every rank already has the whole TP-local tensor; keep my chunk, no scatter
        piece = distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
        local = dst.to_local()
        if local.shape != piece.shape:
            raise CheckpointError(f"FSDP chunk shape {list(piece.shape)} differs from the parameter's local "
                                  f"shape {list(local.shape)}")
        local.copy_(piece)
    else:
        if tuple(dst.shape) != tuple(tp_local.shape):
            raise CheckpointError(f"shape {list(tp_local.shape)} does not fit the tensor {list(dst.shape)}")
        dst.copy_(tp_local)


@torch.no_grad()
def gather_full(t: torch.Tensor, spec: ParamSpec, cfg: ModelConfig, state) -> torch.Tensor | None:
    """The FULL tensor of `t` (the parameter of `spec`, or optimizer state shaped like it) on
    dp rank 0 of every TP group (None elsewhere). Collective over dp, then over tp."""
    local = full_tensor(t).detach()  # DTensor: all-gathers the FSDP dim-0 shards over dp
    if _dp_rank(state) != 0:
        return None
    tp_group, tp, _ = tp_info(state)
    sl = [spec.slice(cfg, r, tp) for r in range(tp)]
    if sl[0].dim is None:
        return local
    # every TP rank's local tensor (equal sizes: padded vocabulary, replicated KV heads)
    whole = all_gather_along(local, sl[0].dim, tp_group)
    parts = list(whole.split(local.shape[sl[0].dim], dim=sl[0].dim))
    return assemble_full(parts, sl, spec.full_shape)


class _Sink:
    """Rank 0's StreamingWriter, or nothing on other ranks. A write error is kept, not raised, so
    that the writer keeps taking part in the remaining collectives; `close` raises it."""

    def __init__(self, make: Callable[[], StreamingWriter] | None):
        self.writer, self.error = None, None
        if make is not None:
            try:
                self.writer = make()
            except Exception as e:  # noqa: BLE001 - raised by close()
                self.error = e

    def write(self, name: str, t: torch.Tensor | None) -> None:
        if self.writer is None or self.error is not None:
            return
        try:
            self.writer.write(name, t)
        except Exception as e:  # noqa: BLE001 - raised by close()
            self.error = e
            self.writer.abort()

    def close(self) -> None:
        if self.error is not None:
            raise self.error
        if self.writer is not None:
            self.writer.close()


def stream_to_file(folder: str, prefix: str, items: dict, is_writer: bool,
                   max_shard_bytes: int | None = None) -> None:
    """items: key -> (dtype, full_shape, fetch); `fetch()` is collective (every rank calls it in the
    same order) and returns the full tensor on the writer. The writer streams PREFIX*.safetensors."""
    specs = {k: (dt, shape) for k, (dt, shape, _) in items.items()}
    sink = _Sink((lambda: StreamingWriter(folder, prefix, specs, max_shard_bytes, {"format": "pt"}))
                 if is_writer else None)
    for key in stream_order(specs):
        dt, _, fetch = items[key]
        t = fetch()
        sink.write(key, None if t is None else t.to(dt))
        del t
    sink.close()


def recompute_rope(module: nn.Module) -> None:
    """`inv_freq` is a non-persistent buffer: garbage after `to_empty`; recompute it from the config."""
    for m in module.modules():
        if isinstance(m, Transformer):
            m.inv_freq = rope_inv_freq(m.cfg).to(m.embed.weight.device)


def check_model_config(saved: dict, cfg: ModelConfig, where: str, strict: bool = True) -> None:
    """strict: every field but LAYOUT_ONLY_FIELDS must agree; else only ARCH_FIELDS."""
    cur = to_dict(cfg)
    if strict:
        check_config(saved, cur, ignore=LAYOUT_ONLY_FIELDS, where=where)
    else:
        check_config({k: saved.get(k, "<absent>") for k in ARCH_FIELDS}, {k: cur[k] for k in ARCH_FIELDS},
                     where=where)


# ---------------------------------------------------------------------------------------------
# model checkpoints


def sidecar_files(m: dict) -> list[str]:
    """The files of manifest `m` beside the tensors that a run reads too: the tokenizer's and
    generation_config.json (its eos ids end the sampled responses)."""
    return sorted(n for n in m["files"] if n.endswith((".json", ".model")) and ".safetensors" not in n
                  and n != "train_state.json")


def load_model_weights(model: nn.Module, path: str, state, *, tokenizer_fingerprint: str | None = None,
                       what: str = "policy", strict_config: bool = True, verify: bool = True) -> dict:
    """Fill `model` (a Transformer or a Critic's `.body`, built for this rank's tp, on a real device
    -- e.g. built on "meta" then `.to_empty(device=...)` -- plain or FSDP-wrapped) from the model
    weights of checkpoint `path`: a model checkpoint, a train checkpoint (its model.safetensors), or
    a root whose latest complete checkpoint is used. Each rank reads only its slices.

    Checks, each failing with one CheckpointError on every rank (state.mesh None: one process):
    `verify` (default on) hashes every model*.safetensors file (and index) and the sidecar files
    (tokenizer, generation_config.json: `sidecar_files`) against the manifest
    before any tensor is read, the hashing split over the ranks (core/ckpt/manifest.verify_files);
    the manifest's model config against `model.cfg` (the field is named; strict_config=False compares
    only the architecture fields), the tokenizer fingerprint when both are known (`what` names the
    model: policy/reference/critic), missing/extra keys, shapes. A stored dtype other than the
    model's is cast (a bf16 checkpoint loads into an fp32 model and vice versa; rank 0 says so on
    stderr). A model without an LM head (critic body) ignores a stored `lm_head.weight`. Recomputes
    the RoPE buffers. Returns the manifest.
    """
    cfg: ModelConfig = model.cfg
    tp_group, tp, tp_rank = tp_info(state)
    group = world_group(state)
    ckpt, m = raise_on_all_ranks(lambda: open_checkpoint(path), group)
    if verify:
        names = raise_on_all_ranks(lambda: tensor_files(ckpt, m, "model"), group)
        verify_files(ckpt, m, names + sidecar_files(m), group)

    def load() -> dict:
        where = f"{what} checkpoint {ckpt}"
        check_model_config(m["model_config"], cfg, where, strict_config)
        if tokenizer_fingerprint is not None and m["tokenizer_fingerprint"] is not None:
            check_tokenizer(m["tokenizer_fingerprint"], tokenizer_fingerprint, what=where)
        if getattr(model, "tp", tp) != tp:
            raise CheckpointError(f"{where}: the model was built for tp={model.tp}, the layout has tp={tp}")
        specs = param_specs(model, cfg, tp)
        meta = [s.name for s in specs if s.param.is_meta]
        if meta:
            raise CheckpointError(f"{where}: parameter '{meta[0]}' is on the meta device; call "
                                  f"model.to_empty(device=...) before loading")
        by_name = {s.name: s for s in specs}
        dtypes = {s.name: s.param.dtype for s in specs}
        ignore = ("lm_head.weight",) if not getattr(model, "with_lm_head", True) else ()
        for name, t in iter_tensors(ckpt, {s.name: s.full_shape for s in specs},
                                    lambda n, _s: by_name[n].slice(cfg, tp_rank, tp),
                                    prefix="model", dtype=dtypes, cast=True, ignore_extra=ignore):
            copy_into(by_name[name].param, t)
        recompute_rope(model)
        return m

    m = raise_on_all_ranks(load, group)
    mine = {dtype_name(p.dtype) for p in model.parameters()}
    if (state is None or state.rank == 0) and mine != {m["dtype"]}:
        print(f"kltron.checkpoint: {what} weights stored as {m['dtype']}, cast to the model's "
              f"{', '.join(sorted(mine))}", file=sys.stderr)
    return m


def model_items(module: nn.Module, cfg: ModelConfig, state, dtype: torch.dtype | None = None) -> dict:
    """`stream_to_file` items for every parameter of `module`."""
    _, tp, _ = tp_info(state)
    return {s.name: (dtype or s.param.dtype, s.full_shape, lambda s=s: gather_full(s.param, s, cfg, state))
            for s in param_specs(module, cfg, tp)}


def save_model_weights(model: nn.Module, path: str, state, *, tokenizer_fingerprint: str | None = None,
                       dtype: torch.dtype | None = None, step: int = 0, max_shard_bytes: int | None = None,
                       extra_files: list[str] | None = None) -> str:
    """Write a kind="model" checkpoint folder exactly at `path` (atomic: a temporary sibling renamed
    into place; an existing checkpoint there is replaced only once the new one is complete; a
    non-empty folder that is no checkpoint is refused). Collective: every rank calls it.

    One parameter at a time: gathered over dp (FSDP) and tp, cast to `dtype` (default: the
    parameter's), written by global rank 0 into model.safetensors (or shards of at most
    `max_shard_bytes` plus an index). `extra_files`: paths of files (e.g. the tokenizer's) copied in
    beside the tensors, under their own names, and hashed in the manifest like them. Returns `path`
    on every rank once the folder is complete.
    """
    cfg: ModelConfig = model.cfg
    _, tp, _ = tp_info(state)
    items = model_items(model, cfg, state, dtype)
    dtypes = sorted({dtype_name(dt) for dt, _, _ in items.values()})
    info = {"kind": "model", "model_config": to_dict(cfg), "tp": tp, "dtype": ",".join(dtypes),
            "tokenizer_fingerprint": tokenizer_fingerprint}
    is_writer = state is None or state.rank == 0

    def write(tmp: str) -> None:
        stream_to_file(tmp, "model", items, is_writer, max_shard_bytes)
        if is_writer:
            for f in extra_files or ():
                shutil.copyfile(f, os.path.join(tmp, os.path.basename(f)))

    return save_checkpoint_at(path, step, write, info=info, group=world_group(state), all_ranks_write=True)
