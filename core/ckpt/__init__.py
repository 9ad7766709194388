"""kltron checkpoints. The files, bottom up (each imports only those above it):

    atomic.py           CheckpointError, atomic durable writes, sha256, raise_on_all_ranks
    safetensors_read.py the strict safetensors reader (one file or an indexed set of shards)
    safetensors_write.py  its writers: whole sets in memory, or one tensor at a time (StreamingWriter)
    tensors.py          full tensors on disk, each rank's TP slice on read; assemble_full
    checks.py           model config and tokenizer agreement between a checkpoint and the run
    train_state.py      train_state.json and the RNG states
    manifest.py         the folder format: manifest, discovery, `latest`, hash verification
    commit.py           the atomic save protocol: seal, rename, `latest`, retention
    model_weights.py    model parameters in and out of a folder, at any tp x dp
    train.py            training checkpoints (modules, AdamW state, run state) and verified resume

Every load verifies the sha256 of every file it opens (`verify=False` turns it off). Import
from `core.ckpt`; the names below are the public surface.
"""

from core.ckpt.atomic import (
    CheckpointError,
    describe_error,
    fsync_dir,
    raise_on_all_ranks,
    sha256_file,
    write_bytes_atomic,
    write_file_atomic,
)
from core.ckpt.checks import check_config, check_tokenizer
from core.ckpt.commit import apply_retention, save_checkpoint_at, save_checkpoint_dir
from core.ckpt.manifest import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    checkpoint_problem,
    files_with_prefix,
    find_latest,
    open_checkpoint,
    read_manifest,
    resolve_checkpoint,
    resume_candidates,
    step_dir_name,
    tensor_files,
    verify_checkpoint,
    verify_files,
)
from core.ckpt.model_weights import (
    check_model_config,
    copy_into,
    dtype_name,
    gather_full,
    load_model_weights,
    param_specs,
    recompute_rope,
    save_model_weights,
    tp_info,
    world_group,
)
from core.ckpt.safetensors_read import (
    DTYPE_NAMES,
    DTYPES,
    SafeFile,
    SafeSet,
    open_safetensors,
    open_safetensors_set,
)
from core.ckpt.safetensors_write import (
    StreamingWriter,
    save_safetensors,
    save_safetensors_set,
    shard_name,
    stream_order,
)
from core.ckpt.tensors import SliceFn, assemble_full, iter_tensors, load_tensors, read_tensors, write_tensors
from core.ckpt.train import load_train_checkpoint, resume_train_checkpoint, save_train_checkpoint
from core.ckpt.train_state import (
    TRAIN_STATE,
    capture_rng_states,
    read_train_state,
    restore_rng_states,
    write_train_state,
)

__all__ = [
    "CheckpointError", "describe_error", "fsync_dir", "raise_on_all_ranks", "sha256_file", "write_bytes_atomic",
    "write_file_atomic",
    "check_config", "check_tokenizer",
    "apply_retention", "save_checkpoint_at", "save_checkpoint_dir",
    "FORMAT_VERSION", "LATEST", "MANIFEST", "checkpoint_problem", "files_with_prefix", "find_latest",
    "open_checkpoint", "read_manifest", "resolve_checkpoint", "resume_candidates", "step_dir_name", "tensor_files",
    "verify_checkpoint", "verify_files",
    "check_model_config", "copy_into", "dtype_name", "gather_full", "load_model_weights", "param_specs",
    "recompute_rope", "save_model_weights", "tp_info", "world_group",
    "DTYPE_NAMES", "DTYPES", "SafeFile", "SafeSet", "open_safetensors", "open_safetensors_set",
    "StreamingWriter", "save_safetensors", "save_safetensors_set", "shard_name", "stream_order",
    "SliceFn", "assemble_full", "iter_tensors", "load_tensors", "read_tensors", "write_tensors",
    "load_train_checkpoint", "resume_train_checkpoint", "save_train_checkpoint",
    "TRAIN_STATE", "capture_rng_states", "read_train_state", "restore_rng_states", "write_train_state",
]
