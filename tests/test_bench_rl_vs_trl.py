"""bench/bench_rl_vs_trl.py at the tiny size, 1 step: the JSON has both sides (TRL only where trl is
importable) with every phase; the exported HF model's logits equal kltron's; the HF tokenizer.json
gives sentencepiece's ids for every benchmark prompt and for the shipped corpus."""

import json

import pytest
import torch

from bench import bench_rl_vs_trl as bench
from core.tokenizer import DEFAULT_CORPUS, load_tokenizer

pytestmark = pytest.mark.slow  # the fixture runs the benchmark: three subprocesses, TRL's start-up

pytest.importorskip("transformers")


PROMPTS, GROUP, NEW = 2, 2, 70  # 70 new tokens: past the tiny size's own 64 positions


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """One run of the benchmark for every test here (the run is most of the module's time): long responses
    (--response-len), few rows, one layer."""
    out = tmp_path_factory.mktemp("bench") / "rl_vs_trl.json"
    threads = torch.get_num_threads()
    try:
        bench.main(["--sizes", "tiny", "--steps", "1", "--warmup", "0", "--gen-reps", "1", "--threads", "1",
                    "--response-len", str(NEW), "--prompts", str(PROMPTS), "--group", str(GROUP), "--layers", "1",
                    "--phases", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    with open(out) as f:
        return json.load(f)


def test_json_has_both_sides(result):
    (res,) = result["results"]
    assert res["size"] == "tiny" and result["steps"] == 1
    assert result["trl"] == bench.trl_available()
    assert res["prompts_checked"] == PROMPTS  # one step's prompts, each checked against sentencepiece
    sides = ["kltron", "trl"] if result["trl"] else ["kltron"]
    for side in sides:
        s = res[side]
        assert s["side"] == side and len(s["steps_s"]) == 1
        assert all(s[p] > 0 for p in ("rollout", "ref_logprobs", "old_logprobs", "update"))
        assert sum(s[p] for p in bench.PHASES) == pytest.approx(s["step"], rel=1e-6)
        assert s["peak_rss"] >= s["rss_after_setup"] > 0
    if not result["trl"]:
        assert "trl" not in res


def test_generation_on_identical_weights(result):
    g = result["results"][0]["generate"]
    assert g["rows"] == PROMPTS * GROUP
    assert g["max_logit_diff"] < 1e-4  # transformers' forward of the exported model vs kltron's
    assert g["kltron_tokens_per_s"] > 0 and g["hf_tokens_per_s"] > 0


def test_hf_tokenizer_matches_sentencepiece(tmp_path):
    """The converted tokenizer.json against sentencepiece itself, on the shipped corpus's lines."""
    bench.write_hf_tokenizer(str(tmp_path), 300)
    sp, ours = load_tokenizer(None), load_tokenizer(str(tmp_path))
    assert ours.vocab_size == 300 and ours.bos_id == sp.bos_id and ours.eos_ids == sp.eos_ids
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f]
    assert lines
    for ln in lines:
        assert ours.encode(ln) == sp.encode(ln), ln
    assert ours.decode(sp.encode(lines[0])) == lines[0]


def test_rounds_pool_every_step():
    """--rounds: each side's timed steps of every round pooled (medians by hand), the highest peak RSS."""
    def run(steps, peak):
        ph = {p: [s / 5 for s in steps] for p in bench.PHASES}
        return {"side": "kltron", "step": sorted(steps)[len(steps) // 2], "steps_s": steps, "phases_s": ph,
                "peak_rss": peak, "rss_after_setup": 10}
    pooled = bench.pool_rounds([run([1.0, 2.0, 9.0], 50), run([3.0, 4.0, 5.0], 70)])
    assert pooled["step"] == 3.5 and pooled["round_steps_s"] == [2.0, 4.0]  # median of 1, 2, 3, 4, 5, 9
    assert pooled["update"] == pytest.approx(0.7) and pooled["peak_rss"] == 70
    assert bench.pool_rounds([run([1.0], 5)])["round_steps_s"] == [1.0]


def test_long_responses_run_to_the_limit_on_both_sides(result):
    """--response-len: kltron's rollout and transformers' generate (TRL's generation, same kwargs) both
    produce N tokens in every row (EOS is never drawn before N), on a model with 64 + N positions."""
    (res,) = result["results"]
    assert result["work"] == {"prompts": PROMPTS, "group": GROUP, "new_tokens": NEW, "min_new_tokens": NEW}
    assert res["kltron"]["response_len_mean"] == NEW
    assert res["generate"]["kltron_tokens"] == res["generate"]["hf_tokens"] == PROMPTS * GROUP * NEW
