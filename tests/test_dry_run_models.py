"""`rl.train --dry-run` before the checkpoint exists: the model's shape from an HF config.json, a preset
or the start checkpoint's folder, else a refusal naming what is missing; the printed shape and
parameter count against counts made without kltron (arithmetic from the published shape, and
`transformers` models built on the meta device from the same config.json). Also the precision
`auto` (bf16 on CUDA only) and the data files named by their key."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from core.config import ConfigError, load_config
from core.model_shapes import PRESETS, shape_from_hf_config
from core.runtime.budget import param_counts
from rl import preflight
from rl import train as rl_train
from rl.config import RLConfig
from rl.experience.prompts import PromptDataError, load_prompt_data
from tests.dist import REPO

transformers = pytest.importorskip("transformers")

MULTINODE = os.path.join(REPO, "configs", "grpo_llama3_8b_multinode.yaml")
QWEN = os.path.join(REPO, "configs", "grpo_gsm8k_qwen2.yaml")
TINY = os.path.join(REPO, "configs", "grpo_tiny.yaml")
# Llama-3-8B by hand: embedding + untied head, 32 x (q, o: H x H; k, v: H x 1024; MLP 3 H x 14336; 2 norms), norm
H, I_, V = 4096, 14336, 128256
LLAMA3_8B_PARAMS = 2 * V * H + 32 * (2 * H * H + 2 * H * 1024 + 3 * H * I_ + 2 * H) + H
HF_SHAPES = {
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                      max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False),
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def _hf_folder(tmp_path, name):
    """config.json as transformers writes it for the published shape (no weights)."""
    cls = transformers.LlamaConfig if HF_SHAPES[name]["model_type"] == "llama" else transformers.Qwen2Config
    c = {k: v for k, v in HF_SHAPES[name].items() if k not in ("model_type",)}
    d = tmp_path / name
    cls(**c).save_pretrained(str(d))
    return d


def _hf_param_count(folder) -> int:
    c = transformers.AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(c)
    return sum(p.numel() for p in m.parameters())  # tied weights are counted once by parameters()


def _dry(capsys, *argv) -> tuple[int, str, str]:
    code = rl_train.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_missing_checkpoint_is_refused_naming_the_options(capsys):
    code, out, err = _dry(capsys, "--config", MULTINODE, "--dry-run", "--world-size", "32")
    assert code == 2 and "projected peak" not in out
    assert "init.checkpoint=/ckpt/llama3.1-8b-instruct holds no converted checkpoint" in err
    assert "--hf-config" in err and "llama3-8b" in err


def test_preset_projects_llama3_8b_on_32_ranks(capsys):
    assert LLAMA3_8B_PARAMS == 8_030_261_248  # the published 8.03B
    code, out, _ = _dry(capsys, "--config", MULTINODE, "--dry-run", "--world-size", "32", "--model", "llama3-8b")
    assert code == 0
    assert "# model: the preset llama3-8b: 32 layers, hidden 4096, heads 32/8 kv, MLP 14336, vocab 128256: " \
           "8.03e9 parameters" in out
    assert "(32 ranks: tp=8 x dp=4, cuda" in out
    grads = float(re.search(r"#   gradients: ([0-9.]+) GiB", out).group(1)) * 2**30
    # fp32 gradients sharded over 32 ranks (the norms replicated over tp: a 1e-4 share)
    assert grads == pytest.approx(LLAMA3_8B_PARAMS * 4 / 32, rel=2e-3)
    peak = float(re.search(r"projected peak per rank .*: ([0-9.]+) GiB", out).group(1))
    assert peak > 3 * LLAMA3_8B_PARAMS * 4 / 32 / 2**30  # at least weights, gradients and AdamW: not the tiny model


@pytest.mark.slow  # the first import of transformers' modeling code takes seconds
@pytest.mark.parametrize("name", sorted(HF_SHAPES))
def test_hf_config_shape_matches_transformers(tmp_path, name):
    folder = _hf_folder(tmp_path, name)
    m = shape_from_hf_config(str(folder))
    assert param_counts(m, 1)["total"] == _hf_param_count(folder)
    assert m == PRESETS[name] or param_counts(PRESETS[name], 1) == param_counts(m, 1)
    assert shape_from_hf_config(str(folder / "config.json")) == m


def test_hf_config_flag_and_unconverted_folder_give_the_preset_plan(tmp_path, capsys):
    folder = _hf_folder(tmp_path, "llama3-8b")
    common = ["--config", MULTINODE, "--dry-run", "--world-size", "16"]
    _, by_preset, _ = _dry(capsys, *common, "--model", "llama3-8b")
    code, by_file, _ = _dry(capsys, *common, "--hf-config", str(folder / "config.json"))
    assert code == 0 and f"# model: the Hugging Face config {folder / 'config.json'}: 32 layers" in by_file
    code, by_init, _ = _dry(capsys, *common, f"init.checkpoint={folder}")
    assert code == 0 and f"the Hugging Face config.json in {folder} (not converted yet)" in by_init

    def peak(t):
        return re.search(r"projected peak per rank .*", t).group(0)
    assert peak(by_preset) == peak(by_file) == peak(by_init)


def test_bad_hf_config_names_file_and_key(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({k: v for k, v in HF_SHAPES["llama3-8b"].items() if k != "intermediate_size"}))
    with pytest.raises(ConfigError, match=r"config\.json: missing key 'intermediate_size'"):
        shape_from_hf_config(str(tmp_path))
    code, _, err = _dry(capsys, "--config", MULTINODE, "--dry-run", "--world-size", "16", "--hf-config", str(bad))
    assert code == 2 and "missing key 'intermediate_size'" in err
    code, _, err = _dry(capsys, "--config", MULTINODE, "--dry-run", "--world-size", "16", "--hf-config", str(bad),
                        "--model", "llama3-8b")
    assert code == 2 and "not both" in err


def test_model_section_when_the_warm_start_builds_it(tmp_path, capsys):
    code, out, _ = _dry(capsys, "--config", TINY, "--dry-run", f"init.sft_dir={tmp_path / 'sft'}", "train.device=cpu")
    assert code == 0 and "# model: the model section (the warm start builds" in out and "2 layers, hidden 64" in out


def test_precision_auto_is_bf16_on_cuda_only(capsys):
    cfg = load_config(RLConfig, QWEN, [])
    assert cfg.train.device == "auto" and cfg.parallel.mixed_precision == "auto"
    assert cfg.parallel.precision("cuda") == "bf16" and cfg.parallel.precision("cpu") == "fp32"
    base = ["--config", QWEN, "--dry-run", "--world-size", "2", "--model", "qwen2.5-0.5b"]
    _, cpu, _ = _dry(capsys, *base, "train.device=cpu")
    _, gpu, _ = _dry(capsys, *base, "train.device=cuda")
    assert "precision fp32" in cpu and "precision bf16" in gpu
    # the sequence the rows can reach: max_prompt_tokens 512 + max_new_tokens 512, not the 32768 positions
    assert "# sequence: 1024 tokens" in cpu
    with pytest.raises(ConfigError, match="parallel.mixed_precision must be fp32, bf16 or auto"):
        preflight.check_rl_config(load_config(RLConfig, QWEN, ["parallel.mixed_precision=fp16"]), 2)


def test_missing_data_files_are_named_by_key(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    cfg = load_config(RLConfig, QWEN, [f"data.train_file={train}", "data.eval_file=/nowhere/test.jsonl"])
    with pytest.raises(PromptDataError, match=r"^data\.eval_file=/nowhere/test\.jsonl: no such file"):
        load_prompt_data(cfg.data, None)
    cfg = load_config(RLConfig, QWEN, [f"data.train_file={tmp_path / 'nope.jsonl'}"])
    with pytest.raises(PromptDataError, match=r"^data\.train_file=.*nope\.jsonl: no such file"):
        load_prompt_data(cfg.data, None)


def test_the_plan_counts_a_distillation_teacher(capsys):
    """A distillation run's plan holds the teacher: its weights (counted from its shape, equal to the built
    model's bytes) in every phase, its hidden states and head copy through the update; pure distillation
    loads no reference (the teacher stands in) and the dry run says so."""
    from dataclasses import replace

    import torch

    from core.config import ModelConfig, load_config
    from core.model import Transformer
    from rl.config import RLConfig
    from rl.preflight import dry_run, memory_plan

    student = ModelConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=176,
                          max_seq_len=64)
    teacher = replace(student, hidden_size=128, n_layers=4, n_heads=8, n_kv_heads=4, intermediate_size=352)
    cpu = torch.device("cpu")
    grpo = load_config(RLConfig, None, [])
    base = memory_plan(grpo, student, 1, cpu)
    built = sum(p.numel() * p.element_size() for p in Transformer(teacher, None, device="meta").parameters())
    cfg = load_config(RLConfig, None, ["distill.coef=0.5", "teacher.sft_dir=/nowhere"])
    cfg.teacher.model = teacher
    with_t = memory_plan(cfg, student, 1, cpu)
    assert with_t["parts"]["teacher"] == built
    assert with_t["rollout_peak"] == base["rollout_peak"] + built
    B = with_t["batch"]
    hidden = B.rollout_rows * B.response_len * teacher.hidden_size * 4 + teacher.padded_vocab_size(1) * 128 * 4
    assert with_t["parts"]["teacher hidden"] == hidden
    assert with_t["update_peak"] == base["update_peak"] + built + hidden
    pure = load_config(RLConfig, None, ["algo.name=distill", "teacher.sft_dir=/nowhere", "kl_ctl.mode=fixed",
                                        "kl_ctl.beta=0"])
    pure.teacher.model = teacher
    plan = memory_plan(pure, student, 1, cpu)
    assert plan["parts"]["reference"] == 0 and plan["placement"] == "the teacher"
    capsys.readouterr()
    dry_run(pure, 1)
    out = capsys.readouterr().out
    assert "# teacher: 4 layers, hidden 128" in out and "standing in for the reference" in out
