"""Training checkpoints: every module's parameters, its AdamW state and the run state, saved at one
layout and loaded at any other tp x dp.

    root/step-XXXXXXXX/
        model.safetensors          the "policy" module (so the folder is also a model checkpoint)
        NAME.safetensors           every other module (e.g. critic: "body.<model name>", "value_head.*")
        NAME-optim.safetensors     its optimizer: "exp_avg/<param>", "exp_avg_sq/<param>" (full,
                                   layout independent, like the parameter) and "step/<param>" (scalar)
        train_state.json           {step, schedule: {NAME: {step_count, skipped_total}},
                                    rng: {world_size, shared | per_rank}, extra}

`modules` maps a name to (module, TrainOptimizer or None); modules may be FSDP-wrapped (or not,
dp = 1) and must have a `.cfg` (Transformer, Critic). Parameters and optimizer state are gathered
one tensor at a time (core/ckpt/model_weights) and resharded on load: each rank reads its TP slice and keeps
its FSDP chunk. AdamW state is created directly in torch's layout ({"step": fp32 scalar,
"exp_avg", "exp_avg_sq"} shaped like the parameter), never by taking a step.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from core.ckpt.atomic import CheckpointError, raise_on_all_ranks
from core.ckpt.commit import save_checkpoint_dir
from core.ckpt.manifest import (
    check_sizes,
    files_with_prefix,
    open_checkpoint,
    resume_candidates,
    tensor_files,
    verify_files,
)
from core.ckpt.model_weights import (
    check_model_config,
    clean_name,
    copy_into,
    dtype_name,
    gather_full,
    model_items,
    param_specs,
    recompute_rope,
    stream_to_file,
    tp_info,
    world_group,
)
from core.ckpt.safetensors_read import open_safetensors_set
from core.ckpt.tensors import iter_tensors
from core.ckpt.train_state import (
    TRAIN_STATE,
    capture_rng_states,
    read_train_state,
    restore_rng_states,
    write_train_state,
)
from core.config import to_dict


def file_prefix(name: str) -> str:
    return "model" if name == "policy" else name


def _check_names(modules: dict) -> None:
    for name in modules:
        if not name or "/" in name or name.startswith(".") or name.endswith("-optim") or (
                name != "policy" and file_prefix(name) == "model"):
            raise CheckpointError(f"module name {name!r} cannot name a checkpoint file")


def _opt_params(module: nn.Module, opt) -> dict[str, torch.Tensor]:
    """The optimizer's parameters by clean name (they must be the module's)."""
    own = {id(p) for p in module.parameters()}
    out = {}
    for n, p in opt.named:
        if id(p) not in own:
            raise CheckpointError(f"optimizer parameter '{n}' is not a parameter of its module")
        out[clean_name(n)] = p
    return out


def _optim_items(module: nn.Module, opt, state) -> dict:
    """stream_to_file items for an optimizer's state: "<key>/<param>" full tensors and scalars."""
    cfg = module.cfg
    _, tp, _ = tp_info(state)
    specs = {s.name: s for s in param_specs(module, cfg, tp)}
    items = {}
    for name, p in _opt_params(module, opt).items():
        st = opt.opt.state.get(p, {})
        for key in sorted(st):
            v = st[key]
            if not isinstance(v, torch.Tensor):
                raise CheckpointError(f"optimizer state '{key}' of '{name}' is not a tensor ({type(v).__name__})")
            if v.dim() == 0:  # the step count: the same on every rank
                items[f"{key}/{name}"] = (torch.float32, (), lambda v=v: v.detach().float().cpu())
            else:
                s = specs[name]
                items[f"{key}/{name}"] = (v.dtype, s.full_shape, lambda v=v, s=s: gather_full(v, s, cfg, state))
    return items


def _rng_state(state) -> dict:
    mine = capture_rng_states()
    group = world_group(state)
    if group is None:
        return {"world_size": 1, "shared": mine}
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)  # control plane: every rank's RNG state, to be written by rank 0
    if all(s == every[0] for s in every):
        return {"world_size": len(every), "shared": every[0]}
    return {"world_size": len(every), "per_rank": every}


def save_train_checkpoint(root: str, step: int, state, modules: dict, *, extra: dict | None = None,
                          keep_last: int | None = None, tokenizer_fingerprint: str | None = None,
                          max_shard_bytes: int | None = None, extra_files: list[str] | None = None) -> str:
    """Save `root/step-XXXXXXXX` (atomic; `latest` updated; the newest `keep_last` kept). Collective:
    every rank calls it with the same modules. `extra`: JSON state of the caller (controller,
    data loader, ...), returned by `load_train_checkpoint`. `extra_files`: paths (the tokenizer's files)
    copied in under their own names and hashed in the manifest. Returns the folder on every rank."""
    _check_names(modules)
    if not modules:
        raise CheckpointError("save_train_checkpoint: no modules")
    main = modules["policy"][0] if "policy" in modules else next(iter(modules.values()))[0]
    _, tp, _ = tp_info(state)
    info = {"kind": "train", "model_config": to_dict(main.cfg), "tp": tp,
            "dtype": dtype_name(next(main.parameters()).dtype), "tokenizer_fingerprint": tokenizer_fingerprint,
            "modules": {n: {"optimizer": o is not None} for n, (_, o) in modules.items()}}
    is_writer = state is None or state.rank == 0

    def write(tmp: str) -> None:
        rng = _rng_state(state)
        for name, (module, opt) in modules.items():
            stream_to_file(tmp, file_prefix(name), model_items(module, module.cfg, state), is_writer,
                           max_shard_bytes)
            if opt is not None:
                stream_to_file(tmp, file_prefix(name) + "-optim", _optim_items(module, opt, state), is_writer,
                               max_shard_bytes)
        if is_writer:
            schedule = {n: {"step_count": o.step_count, "skipped_total": o.skipped_total}
                        for n, (_, o) in modules.items() if o is not None}
            write_train_state(tmp, {"step": step, "schedule": schedule, "rng": rng, "extra": dict(extra or {})})
            for f in extra_files or ():
                shutil.copyfile(f, os.path.join(tmp, os.path.basename(f)))

    return save_checkpoint_dir(root, step, write, info=info, keep_last=keep_last, group=world_group(state),
                               all_ranks_write=True)


def _load_optimizer(ckpt: str, prefix: str, module: nn.Module, opt, state) -> None:
    cfg = module.cfg
    _, tp, tp_rank = tp_info(state)
    specs = {s.name: s for s in param_specs(module, cfg, tp)}
    params = _opt_params(module, opt)
    with open_safetensors_set(ckpt, prefix) as s:
        keys = s.keys()
        origin = s.origin
    expected, target = {}, {}
    for key in keys:
        skey, _, pname = key.partition("/")
        if pname not in params:
            raise CheckpointError(f"{origin}: unexpected key '{key}' (no optimizer parameter '{pname}')")
        p = params[pname]
        if skey == "step":
            expected[key] = ()
        else:
            expected[key] = specs[pname].full_shape
        target[key] = (skey, pname, p)
    have = {t[1] for t in target.values()}
    for pname, p in params.items():
        # torch's AdamW state, created directly (no step taken); a parameter saved without state keeps none
        if pname in have and not {"step", "exp_avg", "exp_avg_sq"} <= {k for k, n, _ in target.values() if n == pname}:
            raise CheckpointError(f"{origin}: optimizer state of '{pname}' lacks step/exp_avg/exp_avg_sq")
        opt.opt.state.pop(p, None)

    def slice_fn(key, _shape):
        skey, pname, _ = target[key]
        return None if skey == "step" else specs[pname].slice(cfg, tp_rank, tp)

    for key, t in iter_tensors(ckpt, expected, slice_fn, prefix=prefix):
        skey, pname, p = target[key]
        st = opt.opt.state[p]
        if skey == "step":
            st["step"] = t.to(torch.float32).clone()
        else:
            st[skey] = torch.zeros_like(p, dtype=t.dtype)
            copy_into(st[skey], t)


def train_files(ckpt: str, m: dict, modules: dict) -> list[str]:
    """The manifest's files a load of `modules` opens: each module's tensors, its optimizer's when
    it has one, and train_state.json. Raises naming what is missing."""
    names = [TRAIN_STATE]
    for name, (_, opt) in modules.items():
        names += tensor_files(ckpt, m, file_prefix(name))
        if opt is not None:
            optim = files_with_prefix(m, file_prefix(name) + "-optim")
            if not optim:
                raise CheckpointError(f"{ckpt}: no optimizer state for '{name}' "
                                      f"({file_prefix(name)}-optim.safetensors missing)")
            names += optim
    return names


def open_train_checkpoint(path: str, modules: dict) -> tuple[str, dict, list[str]]:
    """(folder, manifest, files to open) of train checkpoint `path` (or the latest under a root),
    checked cheaply: kind, modules, every file present with its recorded size."""
    ckpt, m = open_checkpoint(path)
    if m["kind"] != "train":
        raise CheckpointError(f"{ckpt}: a {m['kind']} checkpoint, not a train checkpoint")
    saved_mods = m.get("modules", {})
    for name in modules:
        if name not in saved_mods and name != "policy":
            raise CheckpointError(f"{ckpt}: holds no module '{name}' (it has {sorted(saved_mods)})")
    names = train_files(ckpt, m, modules)
    check_sizes(ckpt, m, names)
    return ckpt, m, names


def _restore(ckpt: str, m: dict, state, modules: dict, verify: bool) -> dict:
    """Load every module, optimizer and the RNG states from the (verified) folder `ckpt`."""
    _, tp, tp_rank = tp_info(state)

    def load() -> dict:
        ts = read_train_state(ckpt, m["files"][TRAIN_STATE] if verify else None)  # hashed as it is read
        for name, (module, opt) in modules.items():
            check_model_config(m["model_config"], module.cfg, f"{name} in {ckpt}")
            specs = param_specs(module, module.cfg, tp)
            by_name = {s.name: s for s in specs}
            for key, t in iter_tensors(ckpt, {s.name: s.full_shape for s in specs},
                                       lambda n, _s, b=by_name, c=module.cfg: b[n].slice(c, tp_rank, tp),
                                       prefix=file_prefix(name), dtype={s.name: s.param.dtype for s in specs},
                                       cast=True):
                copy_into(by_name[key].param, t)
            recompute_rope(module)
            if opt is not None:
                _load_optimizer(ckpt, file_prefix(name) + "-optim", module, opt, state)
                counts = ts.get("schedule", {}).get(name)
                if not isinstance(counts, dict) or not {"step_count", "skipped_total"} <= set(counts):
                    raise CheckpointError(f"{ckpt}/train_state.json: no step_count/skipped_total for '{name}'")
                opt.step_count, opt.skipped_total = int(counts["step_count"]), int(counts["skipped_total"])
        return ts

    ts = raise_on_all_ranks(load, world_group(state))
    rng = ts.get("rng") or {}
    if "shared" in rng:
        restore_rng_states(rng["shared"])
    elif "per_rank" in rng:  # same world size: each rank its own; otherwise rank 0's everywhere
        r = state.rank if state is not None and rng["world_size"] == state.world_size else 0
        restore_rng_states(rng["per_rank"][r])
    return {**ts.get("extra", {}), "step": ts["step"]}


def load_train_checkpoint(path: str, state, modules: dict, *, verify: bool = True) -> dict:
    """Restore every module's parameters and optimizer state, the optimizers' step and skip counts,
    and the RNG states from train checkpoint `path` (or the latest under a root), at this layout.
    `verify` (default on): every file opened is hashed against the manifest before a tensor is
    read (split over the ranks); train_state.json is hashed again as it is read. Returns {"step": int, **extra}.
    Any failure is one CheckpointError on every rank, naming the file."""
    _check_names(modules)
    group = world_group(state)
    ckpt, m, names = raise_on_all_ranks(lambda: open_train_checkpoint(path, modules), group)
    if verify:
        verify_files(ckpt, m, names, group)
    return _restore(ckpt, m, state, modules, verify)


def resume_train_checkpoint(root: str, state, modules: dict, *, verify: bool = True) -> dict | None:
    """Resume from the newest train checkpoint under `root` that verifies (see load_train_checkpoint);
    None when `root` holds no step folder. Rank 0 says on stderr which one was chosen and why every
    newer one was rejected (missing manifest, truncated or missing file, sha256 mismatch, a dangling
    `latest`). Raises CheckpointError listing every rejection when none verifies."""
    _check_names(modules)
    group = world_group(state)
    names, note = raise_on_all_ranks(lambda: resume_candidates(root), group, src=0)
    rejected = [note] if note else []
    for name in names:
        path = os.path.join(root, name)
        try:
            ckpt, m, files = raise_on_all_ranks(lambda p=path: open_train_checkpoint(p, modules), group)
            if verify:
                verify_files(ckpt, m, files, group)
        except CheckpointError as e:
            rejected.append(f"{name} rejected: {e}")
            continue
        if state is None or state.rank == 0:
            why = "".join(f"\n  {r}" for r in rejected)
            print(f"kltron.checkpoint: resuming from {ckpt} (step {m['step']}"
                  f"{', hashes verified' if verify else ', NOT verified: verify off'}){why}", file=sys.stderr)
        return _restore(ckpt, m, state, modules, verify)
    if rejected:
        raise CheckpointError(f"{root}: no checkpoint to resume from verifies; move the folders away or set "
                              f"train.resume=false to start over:\n  " + "\n  ".join(rejected))
    return None
