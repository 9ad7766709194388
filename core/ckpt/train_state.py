"""Training state saved beside the tensors of a train checkpoint: `train_state.json` (plain JSON, no
pickle) and the RNG states of torch (CPU and CUDA), Python `random` and numpy, as base64/lists.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
from collections.abc import Mapping

import numpy as np
import torch

from core.ckpt.atomic import CheckpointError, write_bytes_atomic

TRAIN_STATE = "train_state.json"

TRAIN_STATE_KEYS = ("step", "schedule", "rng", "data", "extra")


def write_train_state(folder: str, state: Mapping) -> None:
    """Write `train_state.json`: {step: int, schedule: dict, rng: dict, data: dict, extra: dict}."""
    unknown = [k for k in state if k not in TRAIN_STATE_KEYS]
    if unknown or not isinstance(state.get("step"), int):
        raise CheckpointError(f"train state: unknown keys {unknown} or missing int 'step' "
                              f"(allowed keys {TRAIN_STATE_KEYS}; put free-form state under 'extra')")
    try:
        data = json.dumps(dict(state), indent=1, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"train state is not plain JSON ({e})") from e
    write_bytes_atomic(os.path.join(folder, TRAIN_STATE), data)


def read_train_state(folder: str, sha256: str | None = None) -> dict:
    """The train state of checkpoint `folder`. With `sha256` (the manifest's digest) the bytes are
    hashed as they are read and a mismatch is refused, naming the file: no second read."""
    path = os.path.join(folder, TRAIN_STATE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the train state ({e})") from e
    if sha256 is not None:
        found = hashlib.sha256(raw).hexdigest()
        if found != sha256:
            raise CheckpointError(f"{path}: sha256 mismatch (manifest {sha256}, file {found}): corrupt file")
    try:
        state = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the train state ({e})") from e
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{path}: expected a JSON object with an integer 'step'")
    return state


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_states() -> dict:
    """torch CPU (and CUDA, per device), Python `random` and numpy global RNG states, as JSON."""
    py = random.getstate()
    npst = np.random.get_state()
    out = {"torch": _b64(torch.get_rng_state()),
           "python": [py[0], list(py[1]), py[2]],
           "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])]}
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng_states(states: Mapping) -> None:
    torch.set_rng_state(_unb64(states["torch"]))
    v, seq, gauss = states["python"]
    random.setstate((v, tuple(seq), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in states["cuda"]])
