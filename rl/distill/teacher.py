"""The frozen teacher: checked against the student's checkpoint, loaded and sharded like the reference
(TP, FSDP2 over the DP mesh, optional CPU offload, bf16 weights with the fp32 divergence path), and its
final hidden states at the response positions computed once per step on the sampled sequences
(rl/update/distill_step.py).

The teacher may differ from the student in size (hidden width, layers, heads): only its head's
vocabulary must match, row for row, so both checkpoints must carry the same tokenizer fingerprint
and the same vocabulary size. A mismatch is one ConfigError naming both checkpoints.
"""

from __future__ import annotations

import core.ckpt as ckpt
from core.config import ConfigError, ModelConfig, from_dict


def teacher_model_config(student_ckpt: str, teacher_ckpt: str, tokenizer_fp: str | None = None) -> ModelConfig:
    """The teacher's ModelConfig after the checks (module docstring); the same result on every rank."""
    sm, tm = ckpt.read_manifest(student_ckpt), ckpt.read_manifest(teacher_ckpt)
    check_compatible(sm, tm, student_ckpt, teacher_ckpt, tokenizer_fp)
    return from_dict(ModelConfig, tm["model_config"])


def check_compatible(student: dict, teacher: dict, student_path: str, teacher_path: str,
                     tokenizer_fp: str | None = None) -> None:
    """Refuse a teacher whose tokenizer fingerprint or vocabulary differs from the student's manifest."""
    sf, tf = student.get("tokenizer_fingerprint"), teacher.get("tokenizer_fingerprint")
    if sf is None or tf is None:
        which = "student checkpoint " + student_path if sf is None else "teacher checkpoint " + teacher_path
        raise ConfigError(f"teacher.checkpoint: the {which} records no tokenizer fingerprint, so the two "
                          f"vocabularies cannot be checked to agree (student {student_path}, teacher {teacher_path})")
    if sf != tf:
        raise ConfigError(f"teacher.checkpoint: tokenizer mismatch: the teacher {teacher_path} was saved with "
                          f"tokenizer {tf[:16]}..., the student {student_path} with {sf[:16]}...; distillation "
                          f"over the full vocabulary needs the same tokenizer")
    if tokenizer_fp is not None and tf != tokenizer_fp:
        raise ConfigError(f"teacher.checkpoint: the teacher {teacher_path} was saved with tokenizer {tf[:16]}..., "
                          f"the run's tokenizer is {tokenizer_fp[:16]}...")
    sv, tv = student["model_config"]["vocab_size"], teacher["model_config"]["vocab_size"]
    if sv != tv:
        raise ConfigError(f"teacher.checkpoint: vocabulary mismatch: the teacher {teacher_path} has vocab_size="
                          f"{tv}, the student {student_path} vocab_size={sv}")
