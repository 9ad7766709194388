"""Agreement checks between a checkpoint and the run loading it: model config and tokenizer."""

from __future__ import annotations

from collections.abc import Mapping

from core.ckpt.atomic import CheckpointError


def _norm(v):
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _norm(x) for k, x in v.items()}
    return v


_ABSENT = "<absent>"


def _first_difference(saved, current, prefix: str):
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        for k in list(current) + [k for k in saved if k not in current]:
            d = _first_difference(saved.get(k, _ABSENT), current.get(k, _ABSENT), f"{prefix}{k}.")
            if d:
                return d
        return None
    return None if _norm(saved) == _norm(current) else (prefix[:-1], saved, current)


def check_config(saved: Mapping, current: Mapping, *, ignore=(), where: str = "checkpoint") -> None:
    """Raise CheckpointError naming the first field (dotted) whose values differ, with both values.
    Lists and tuples compare equal; fields in `ignore` (top-level names) are skipped."""
    d = _first_difference({k: v for k, v in saved.items() if k not in ignore},
                          {k: v for k, v in current.items() if k not in ignore}, "")
    if d:
        field, a, b = d
        raise CheckpointError(f"{where}: model config field '{field}' differs: checkpoint has {a!r}, "
                              f"current config has {b!r}")


def check_tokenizer(manifest_fp: str | None, tokenizer_fp: str | None, what: str = "policy/reference",
                    allow_missing: bool = False) -> None:
    """Raise CheckpointError unless both fingerprints are present and equal."""
    if manifest_fp is None or tokenizer_fp is None:
        if allow_missing:
            return
        side = "the checkpoint records" if manifest_fp is None else "the current tokenizer has"
        raise CheckpointError(f"tokenizer check ({what}): {side} no fingerprint")
    if manifest_fp != tokenizer_fp:
        raise CheckpointError(f"tokenizer mismatch ({what}): checkpoint was saved with tokenizer {manifest_fp}, "
                              f"the current tokenizer is {tokenizer_fp}")
