"""scripts/gpu_check.sh --cpu: the tiny CPU version of every GPU-check section runs, and the one
JSON it writes has every section with status ok and the numbers its table reads."""

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("layout", "hf_parity", "mfu_eager", "grpo_tiny", "grpo_0p5b", "kl_head", "bf16_kl", "kl_memory", "sampler",
            "layout_cost", "context_parallel", "invariant", "mfu_compile")


@pytest.mark.slow
def test_gpu_check_cpu_version(tmp_path):
    pytest.importorskip("transformers")  # the HF parity section
    env = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    with open(tmp_path / "gpu_check.json") as f:
        rep = json.load(f)
    assert rep["mode"] == "cpu" and tuple(rep["sections"]) == SECTIONS
    for name, sec in rep["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"), sec.get("log_tail"))
    r = {k: v["result"] for k, v in rep["sections"].items()}
    assert all(c["ok"] for c in r["layout"]["checks"]) and r["layout"]["checks"]
    assert all(k["ok"] and k["max_abs_err"] <= 1e-4 for k in r["hf_parity"]["kinds"].values())
    assert r["mfu_compile"]["compile"] and not r["mfu_eager"]["compile"]
    assert r["mfu_compile"]["loss"] == pytest.approx(r["mfu_eager"]["loss"], rel=1e-3)  # same steps, same data
    for g in ("grpo_tiny", "grpo_0p5b"):
        assert all(r[g][f"peak_mem_{k}_bytes"] > 0 for k in ("rollout", "ref", "old", "update"))
        assert all(r[g][f"time_{k}_s"] > 0 for k in ("rollout", "ref_logprobs", "old_logprobs", "update"))
        assert r[g]["step_time_s"] >= r[g]["time_rollout_s"]
    assert {m["method"] for m in r["kl_head"]["methods"]} == {"gather", "fused"}
    assert 0 < r["kl_head"]["fused_over_gather_memory"] < 1  # CPU: the allocator's events (RSS read 0)
    assert r["bf16_kl"]["fused"]["max_abs_err"] < r["bf16_kl"]["bf16_logits"]["max_abs_err"]
    km = r["kl_memory"]  # measured (MemTracker on CPU) against the meta-tensor projection, per method
    assert set(km["methods"]) == {"matmul_floor", "gather", "fused_exact_loss", "fused_k3_loss"}
    assert all(abs(m["projection_error"]) <= 0.10 for m in km["methods"].values())
    assert km["gather_over_exact_memory"] > 1.0
    assert {"eager", "compiled", "eager top_p=0.9"} <= set(r["sampler"]["sampler"])
    lc = r["layout_cost"]["rows"]  # the shared layout's plans against padding, one row per shape
    assert [(x["P"], x["N"]) for x in lc] == [(16, 6), (32, 64)]
    assert all(x[k]["s"] > 0 and x[k]["model"] > 0 for x in lc for k in ("padded", "default", "cost"))
    cp = r["context_parallel"]  # cp=2 exactness on gloo, and the update's per-rank peak against cp=1
    assert cp["checks"] and all(c["ok"] for c in cp["checks"])
    assert [x["cp"] for x in cp["steps"]] == [2, 2, 1] and all(x["peak_over_cp1"] < 0.6 for x in cp["steps"][:2])
    inv = r["invariant"]  # fp32 and bf16 bit-equal with the mode on; the bf16 mismatch with it off is not 0
    assert len(inv["checks"]) == 2 and all(c["ok"] for c in inv["checks"])
    assert inv["off_bf16"]["logp_max_abs_diff_padded"] > 0 and set(inv["timing"]) == {"fp32", "bf16"}
    assert "| section" in p.stdout  # the table
