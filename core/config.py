"""Typed configuration: dataclasses filled from YAML plus `key.sub=value` overrides.

Unknown keys and wrong types are rejected with the dotted name of the culprit. Each component
takes only its own section (`ModelConfig`, `OptimConfig`, ...). Entry points define their top-level
dataclass from these sections (`SFTConfig` here; the RL layer adds its own in `rl/`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""


@dataclass
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 176
    head_dim: int | None = None  # default hidden_size // n_heads
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    # None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    #           "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2 / Qwen2.5
    tie_embeddings: bool = False
    init_std: float = 0.02
    vocab_pad_multiple: int = 64
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None

    def __post_init__(self):
        if self.head_dim is None and self.n_heads and self.hidden_size % self.n_heads == 0:
            self.head_dim = self.hidden_size // self.n_heads

    def validate(self) -> ModelConfig:
        for k in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size",
                  "max_seq_len", "vocab_pad_multiple"):
            if getattr(self, k) < 1:
                raise ConfigError(f"model.{k} must be positive, got {getattr(self, k)}")
        if self.head_dim is None:
            raise ConfigError(f"model.head_dim is not set and hidden_size={self.hidden_size} is not a "
                              f"multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even for RoPE")
        return self

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of both tp and `vocab_pad_multiple`."""
        m = self.vocab_pad_multiple * tp // math.gcd(self.vocab_pad_multiple, tp)
        return -(-self.vocab_size // m) * m


@dataclass
class ParallelConfig:
    tp: int = 1
    dp: int = -1  # -1: world_size // (tp * cp)
    # context parallel: ranks that split every sequence of the RL passes (parallel/context.py), ulysses or ring
    cp: int = 1
    cp_impl: str = "ring"
    fsdp: bool = True  # shard parameters over dp with FSDP2 when dp > 1
    mixed_precision: str = "fp32"  # "fp32", "bf16" (bf16 params/compute, fp32 reduce), "auto": bf16 on CUDA only
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    timeout_s: float = 600.0  # collective timeout: a rank frozen this long ends the run with an error
    # > 0: name the rank and phase that has not advanced in this many seconds; end the run when a peer is frozen
    # (its alive-beat unchanged for max(2 * watchdog_s, 10 s): core/runtime/lifecycle.py, docs/reliability.md)
    watchdog_s: float = 0.0
    # every token's forward bits independent of the batch: the rollout's decode log-probs equal the
    # trainer's, bit for bit (parallel/invariant.py; cost: docs/design.md "Batch-invariant mode")
    batch_invariant: bool = False
    # > 0: this many of the launch's ranks only generate (rl/pipeline: one-step-off asynchronous RL); the
    # other world - rollout_ranks ranks train, laid out by tp and dp as above; rollout_tp: the rollout ranks' tp
    rollout_ranks: int = 0
    rollout_tp: int = 1
    # Megatron sequence parallelism inside TP: norms, residuals and the embedding's output hold [B, S/tp, H] in
    # full-sequence forwards (core/seq_parallel.py; docs/design.md "Sequence parallelism"); no effect at tp=1
    sequence_parallel: bool = False

    def resolve_dp(self, world_size: int) -> int:
        """parallel.dp (-1: world_size // tp), after checking parallel.tp, .dp and .timeout_s by name."""
        check_parallel(self, world_size)
        return world_size // (self.tp * self.cp) if self.dp == -1 else self.dp

    def precision(self, device_type: str) -> str:
        """The mixed precision a run on `device_type` uses: "auto" is bf16 on CUDA and fp32 elsewhere (bf16
        autocast on CPU is slower than fp32); "fp32" and "bf16" are taken as written."""
        if self.mixed_precision == "auto":
            return "bf16" if device_type == "cuda" else "fp32"
        return self.mixed_precision


def _positive_int(key: str, v, allow: tuple = ()) -> None:
    if v in allow:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        extra = f" or {' / '.join(map(str, allow))}" if allow else ""
        extra += " (0: keep all)" if key == "train.keep_last" else ""
        raise ConfigError(f"{key} must be a positive integer{extra}, got {v!r}")


def check_parallel(p: ParallelConfig, world_size: int) -> None:
    """Named errors for a `parallel` section that cannot run on `world_size` ranks (pure arithmetic)."""
    _positive_int("parallel.tp", p.tp)
    _positive_int("parallel.dp", p.dp, allow=(-1,))
    if p.dp == -1 and world_size % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} does not divide the world size {world_size}")
    if p.tp > world_size:
        raise ConfigError(f"parallel.tp={p.tp} is larger than the world size {world_size}")
    _positive_int("parallel.cp", p.cp)
    if p.cp_impl not in ("ulysses", "ring"):
        raise ConfigError(f"parallel.cp_impl must be ulysses or ring, got {p.cp_impl!r}")
    if p.dp == -1 and world_size % (p.tp * p.cp):
        raise ConfigError(f"parallel.tp={p.tp} * parallel.cp={p.cp} = {p.tp * p.cp} does not divide the world "
                          f"size {world_size}")
    if not isinstance(p.batch_invariant, bool):
        raise ConfigError(f"parallel.batch_invariant must be true or false, got {p.batch_invariant!r}")
    if not isinstance(p.sequence_parallel, bool):
        raise ConfigError(f"parallel.sequence_parallel must be true or false, got {p.sequence_parallel!r}")
    if p.mixed_precision not in ("fp32", "bf16", "auto"):
        raise ConfigError(f"parallel.mixed_precision must be fp32, bf16 or auto, got {p.mixed_precision!r}")
    if not (math.isfinite(p.timeout_s) and p.timeout_s > 0):
        raise ConfigError(f"parallel.timeout_s must be a positive number of seconds, got {p.timeout_s!r}")
    _positive_int("parallel.rollout_tp", p.rollout_tp)
    if not isinstance(p.rollout_ranks, int) or isinstance(p.rollout_ranks, bool) or p.rollout_ranks < 0 or \
            p.rollout_ranks % p.rollout_tp:
        raise ConfigError(f"parallel.rollout_ranks must be an int >= 0 (0: rollout on the trainer ranks) and a "
                          f"multiple of parallel.rollout_tp={p.rollout_tp}, got {p.rollout_ranks!r}")
    if not (math.isfinite(p.watchdog_s) and p.watchdog_s >= 0):
        raise ConfigError(f"parallel.watchdog_s must be >= 0 seconds (0: off), got {p.watchdog_s!r}")


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 10
    decay_steps: int | None = None  # None: the run's total steps
    schedule: str = "cosine"  # "cosine" | "constant"
    grad_clip: float = 1.0  # <= 0 disables clipping
    skip_nonfinite: bool = True  # skip (on every rank) steps whose grad norm is not finite
    # torch AdamW kernel: "fused" (one kernel per parameter, no temporaries; CPU and CUDA, as torchtitan's
    # default) or "foreach" (multi-tensor ops); the same update up to float rounding order
    implementation: str = "fused"


@dataclass
class DataConfig:
    text_file: str | None = None  # None: the shipped corpus
    tokenizer: str | None = None  # sentencepiece .model; None: the shipped tiny tokenizer
    seq_len: int = 128
    micro_batch_size: int = 8  # sequences per DP rank per micro-step
    grad_accum: int = 1


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 1234
    log_every: int = 1
    out_dir: str = "runs/sft"
    save_every: int = 0  # 0: save only at the end
    stop_after: int | None = None  # end this run after this step (a job time limit); resume continues
    keep_last: int = 2  # training checkpoints kept (0: all)
    resume: bool = True
    allow_config_change: bool = False  # resume although the config differs from the run's config.yaml
    verify_checkpoints: bool = True  # hash every checkpoint file a load opens; resume falls back to one that verifies
    progress: bool = True
    device: str = "auto"  # "auto", "cpu" or "cuda"
    compile: bool = False  # torch.compile each transformer block (full-sequence forwards; decoding stays eager)
    # on CUDA, refuse at start-up a run whose projected peak (core.runtime.budget) exceeds the GPU
    memory_check: bool = True


def _writable_dir(key: str, path: str) -> None:
    """ConfigError naming `key` unless `path` is (or can be created as) a writable directory."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{key}={path}: {probe} exists and is not a directory")
    try:  # a real write: os.access says yes to root on a read-only mount
        fd, tmp = tempfile.mkstemp(prefix=".kltron-probe-", dir=probe)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise ConfigError(f"{key}={path}: directory {probe} is not writable ({e.strerror})") from None


def check_train(t: TrainConfig) -> None:
    """Named errors for a `train` section that would misbehave (pure: no collective, no file written)."""
    _positive_int("train.steps", t.steps)
    _positive_int("train.log_every", t.log_every)
    _positive_int("train.keep_last", t.keep_last, allow=(0,))  # 0: keep every checkpoint
    if not isinstance(t.save_every, int) or t.save_every < 0:
        raise ConfigError(f"train.save_every must be >= 0 (0: save only at the end), got {t.save_every!r}")
    if t.stop_after is not None:
        _positive_int("train.stop_after", t.stop_after)
    if t.device not in ("auto", "cpu", "cuda") and not t.device.startswith("cuda:"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got {t.device!r}")
    if t.device.startswith("cuda") and not torch_cuda_available():
        raise ConfigError(f"train.device={t.device} but CUDA is not available")
    _writable_dir("train.out_dir", t.out_dir)


def torch_cuda_available() -> bool:
    import torch  # here, so that reading a config does not need torch

    return torch.cuda.is_available()


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    init_checkpoint: str | None = None


# ---------------------------------------------------------------------------------------------
# loading


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str):
    """Check/convert `value` to the annotated type `tp`; raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if tp in (tuple, list) or origin in (tuple, list):
        if isinstance(value, (list, tuple)):
            return tuple(value) if (tp is tuple or origin is tuple) else list(value)
        raise ConfigError(f"{key}: expected a list, got {value!r}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return value


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict; unknown keys raise ConfigError naming them."""
    prepare = getattr(cls, "prepare_dict", None)  # a section that rewrites its dict first (RLConfig: algo.recipe)
    data, attrs = prepare(data) if prepare is not None else (data, {})
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"unknown config key '{prefix}{k}' (known in this section: "
                              f"{', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from e
    for k, v in attrs.items():  # not fields: never saved with the config nor compared on resume
        setattr(obj, k, v)
    return obj


def to_dict(obj) -> dict:
    """Dataclass -> plain nested dict (tuples become lists), suitable for YAML/JSON."""
    def conv(v):
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    return conv(obj)


def _set_dotted(d: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        nxt = d.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section")
        d = nxt
    d[parts[-1]] = value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `key.sub=value` strings (values parsed as YAML scalars) to a nested dict."""
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override '{o}' is not of the form key.sub=value")
        k, v = o.split("=", 1)
        _set_dotted(data, k.strip(), yaml.safe_load(v) if v.strip() else None)
    return data


def load_config(cls, path: str | None = None, overrides: list[str] | None = None):
    """Load dataclass `cls` from a YAML file (optional) and `key.sub=value` overrides."""
    data: dict = {}
    if path is not None:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    apply_overrides(data, overrides or [])
    return from_dict(cls, data)
