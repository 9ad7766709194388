"""bench/bench_rl_step.py on a micro config: the JSON has every row and field, and the measured
memory agrees with quantities counted from the model's shape, AdamW's state and the KL algorithm."""

import json

import pytest
import torch

from bench import bench_rl_step as bench
from core.config import ModelConfig

pytestmark = pytest.mark.slow  # the fixture runs the benchmark

V, H, I, L, NH, NKV = 2048, 16, 32, 1, 2, 1
MICRO = bench.BenchConfig(
    ModelConfig(vocab_size=V, hidden_size=H, n_layers=L, n_heads=NH, n_kv_heads=NKV, intermediate_size=I,
                max_seq_len=32),
    ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "algo.epochs=1",
     "algo.mini_batches=2", "algo.kl_chunk_size=4"],
    kl_chunk=1)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "rl_step.json"
    threads = torch.get_num_threads()
    try:
        bench.main(["--configs", "micro", "--steps", "1", "--json", str(out)], configs={"micro": MICRO})
    finally:
        torch.set_num_threads(threads)
    with open(out) as f:
        return json.load(f)


def _n_params(with_lm_head: bool) -> int:
    """Llama-shape parameter count, by hand: untied embedding and head, GQA, SwiGLU, RMSNorms."""
    hd = H // NH
    layer = H * NH * hd + 2 * H * NKV * hd + NH * hd * H + 3 * H * I + 2 * H
    return V * H * (2 if with_lm_head else 1) + L * layer + H


def test_rows_and_fields(result):
    (res,) = result["results"]
    assert res["config"] == "micro" and result["steps"] == 1
    assert [t["algo"] for t in res["time"]] == ["grpo", "ppo"]
    for t in res["time"]:
        parts = [t[k] for k in ("rollout", "ref_logprobs", "old_logprobs", "update", "other")]
        assert all(p >= 0 for p in parts[:4]) and sum(parts) == pytest.approx(t["step"], rel=1e-6)
        assert t["tokens_per_s"] == pytest.approx(t["response_tokens"] / t["step"], rel=1e-6)
    assert [m["model"] for m in res["memory"]] == ["policy", "reference", "critic"]
    assert [k["method"] for k in res["kl_memory"]] == ["logits", "fused"]


def test_param_and_optimizer_bytes_match_the_shape(result):
    mem = {m["model"]: m for m in result["results"][0]["memory"]}
    for name, with_head in (("policy", True), ("reference", True), ("critic", False)):
        n = _n_params(with_head) + (H + 1 if name == "critic" else 0)  # the value head Linear(H, 1)
        assert mem[name]["param_bytes"] == 4 * n, name
        assert mem[name]["peak_param"] == 4 * n, name  # MemTracker saw exactly the parameters
    # AdamW: exp_avg and exp_avg_sq per parameter (fp32) and a 0-dim fp32 step per tensor
    n_tensors = {"policy": 3 + 9 * L, "critic": 2 + 9 * L + 2}
    for name in ("policy", "critic"):
        want = 2 * mem[name]["param_bytes"] + 4 * n_tensors[name]
        assert mem[name]["opt_state_bytes"] == want and mem[name]["peak_opt"] == want, name
    assert mem["reference"]["opt_state_bytes"] == 0 and mem["reference"]["peak_grad"] == 0


def test_logits_method_holds_six_logits_tensors_and_fused_none(result):
    logits, fused = result["results"][0]["kl_memory"]
    T = logits["tokens"]
    assert T == 2 * 16  # one mini-batch: 2 rows x 16 response positions
    tv4 = T * V * 4  # one fp32 [T, V] tensor
    assert logits["logits_bytes"] == tv4
    # forming p * (log p - log q) needs z_p, log p, log q, p, log p - log q and the product alive
    assert logits["peak_bytes"] >= 6 * tv4
    assert logits["peak_bytes"] <= 9 * tv4  # and not much more: the model itself is tiny next to V
    # the fused head (1 token per chunk) holds O(V) besides the gradients of the embedding and the
    # head ([V, H] each): its peak does not grow with T x V
    assert 2 * V * H * 4 <= fused["peak_bytes"] <= 2 * V * H * 4 + 0.25 * tv4
    assert fused["ratio"] == pytest.approx(fused["peak_bytes"] / logits["peak_bytes"])
