"""tools.long_fit (what fits for long responses) against arithmetic written out here: the layouts enumerated,
the gathered-logits head's [T, Vp] fp32 tensors, SP's saving of the norms' and projections' activations and of
the checkpointed block inputs, cp's split of the tokens and of the FSDP shards."""

from __future__ import annotations

import pytest

from core.model_shapes import PRESETS
from tools import long_fit

CFG = PRESETS["llama3-8b"]
H, L, VP = 4096, 32, 128256  # the padded vocabulary is a multiple of 64 x tp for tp <= 8: 128256 = 64 x 2004
T128 = 128 * 1024


def _row(rows, **kw):
    (r,) = [r for r in rows if all(r[k] == v for k, v in kw.items())]
    return r


def test_layouts_of_eight_gpus():
    got = sorted(long_fit.layouts(CFG, 8))
    assert got == [(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2),
                   (4, 2, 1), (8, 1, 1)]
    rows = long_fit.plan(CFG, 8, T128)
    assert len(rows) == 2 * (10 + 6)  # two KL paths; SP on and off where tp > 1


def test_gathered_logits_head_and_cp_split():
    rows = long_fit.plan(CFG, 8, T128)
    for cp in (1, 2, 8):
        tp, dp = 1, 8 // cp
        gather = _row(rows, tp=tp, cp=cp, dp=dp, sp=False, kl="gather")["parts"]["KL head"]
        T = T128 // cp  # the response tokens of one row, split over cp
        assert gather == 7 * T * VP * 4 + T * H * 2  # seven fp32 [T, Vp] tensors and bf16 grad hidden [T, H]
    one, two = (_row(rows, tp=1, cp=c, dp=8 // c, sp=False, kl="fused")["parts"] for c in (1, 2))
    assert two["gradients"] == one["gradients"]  # FSDP over dp x cp = 8 ranks either way
    seq = "sequence activations"
    assert abs(two[seq] * 2 - one[seq]) <= 4 * (2 * H * L)  # rounding of odd tokens


def test_sequence_parallel_saving_is_norms_projection_inputs_and_block_inputs():
    rows = long_fit.plan(CFG, 8, T128, prompt=1024)
    off, on = (_row(rows, tp=8, cp=1, dp=1, sp=sp, kl="fused") for sp in (False, True))
    T = T128 + 1024
    # checkpointed block inputs L x H, one recomputed layer's two norms 4H and projection inputs 2H, the final
    # norm 2H, bf16, cut to 1/8
    saved = (L * H + 4 * H + 2 * H + 2 * H) * T * 2 * 7 // 8
    assert off["parts"]["sequence activations"] - on["parts"]["sequence activations"] == saved
    assert off["parts"]["activations"] == on["parts"]["activations"]
    assert off["update_peak"] - on["update_peak"] == saved
    for r_off in rows:  # SP never costs memory
        if r_off["sp"] is False and r_off["tp"] > 1:
            r_on = _row(rows, tp=r_off["tp"], cp=r_off["cp"], dp=r_off["dp"], sp=True, kl=r_off["kl"])
            assert r_on["peak_bytes"] <= r_off["peak_bytes"]


def test_cli_writes_the_table(tmp_path):
    out = tmp_path / "fit.md"
    long_fit.main(["--response", "32k", "--gpu-gb", "80", "--markdown", str(out)])
    text = out.read_text()
    assert text.startswith("| tp | cp | dp | SP | KL path | 32k on 80 GB |")
    assert text.count("\n| ") == 32 and "llama3-8b, 32k-token responses, 80 GB GPUs:" in text


@pytest.mark.slow  # two FakeTensorMode projections: ~5 s
def test_kl_memory_project_splits_tokens_over_cp(tmp_path):
    """tools.kl_memory --project --cp 4: each rank's head over T / 4 tokens, the row as projected at T / 4 without
    cp; the gathered-logits row near the budget's seven fp32 [T / cp, Vp] tensors (tools/long_fit's KL path)."""
    from tools import kl_memory

    common = ["--hidden", "64", "--vocab", "1000", "--dtype", "bf16", "--project", "--methods", "gather,fused_exact"]
    cp = kl_memory.main(["--tokens", "4096", "--cp", "4", "--json", str(tmp_path / "a.json"), *common])
    plain = kl_memory.main(["--tokens", "1024", "--json", str(tmp_path / "b.json"), *common])
    for a, b in zip(cp, plain):
        assert (a["tokens"], a["tokens_total"], a["cp"]) == (1024, 4096, 4)
        assert a["peak_bytes"] == b["peak_bytes"] and a["name"] == b["name"]
    gather = next(r for r in cp if r["name"] == "gather")["peak_bytes"]
    assert abs(gather - 7 * 1024 * 1024 * 4) <= 0.15 * gather  # Vp = 1024 (1000 padded to 64)


def test_dry_run_names_sequence_parallelism(capsys):
    """rl.train --dry-run at tp=8 says whether SP is on and, when it is off, what turning it on would leave of the
    sequence activations: 1/8 of the checkpointed block inputs, of one layer's norm and projection inputs and of
    the final norm (no LoRA), in bf16."""
    import os
    import re

    from rl import train as rl_train
    from tests.dist import REPO

    config = os.path.join(REPO, "configs", "grpo_llama3_8b_multinode.yaml")
    out = {}
    for sp in ("true", "false"):
        assert rl_train.main(["--config", config, "--dry-run", "--world-size", "32", "--model", "llama3-8b",
                              f"parallel.sequence_parallel={sp}"]) == 0
        out[sp] = capsys.readouterr().out
    assert "sequence parallelism on" in out["true"] and "with parallel.sequence_parallel=true" not in out["true"]
    assert "sequence parallelism off" in out["false"]
    got = lambda text, key: float(re.search(rf"#   {key}: ([0-9.]+) GiB", text).group(1))  # noqa: E731
    on, off = got(out["true"], "sequence activations"), got(out["false"], "sequence activations")
    assert on == pytest.approx(off / 8, abs=2e-3)  # every term of the part divides by tp
    line = re.search(r"# with parallel.sequence_parallel=true: peak ([0-9.]+) GiB, sequence activations ([0-9.]+)",
                     out["false"])
    assert float(line.group(2)) == on
    assert float(line.group(1)) == float(re.search(r"projected peak per rank .*: ([0-9.]+) GiB", out["true"]).group(1))
