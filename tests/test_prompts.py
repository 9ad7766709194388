"""rl.experience.prompts: records, chat rendering and tokenization checked against transformers and hand-built
expectations; the global order checked by enumeration over DP layouts; every bad input named."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from core.tokenizer import DATA_DIR, DEFAULT_CORPUS, load_tokenizer
from rl.experience.prompts import (
    PromptDataConfig,
    PromptDataError,
    PromptSampler,
    eval_rank_indices,
    load_prompt_data,
    load_prompt_set,
    read_records,
)
from tools.train_tokenizer import train_hf_tokenizer

TRAIN = f"{DATA_DIR}/arith_word_train.jsonl"
TEST = f"{DATA_DIR}/arith_word_test.jsonl"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2tok")
    train_hf_tokenizer(DEFAULT_CORPUS, str(d), 400, "qwen2")
    return d


def _write(path, lines):
    path.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return str(path)


def test_shipped_word_problems_are_correct():
    """Every equation of every solution holds, and '#### N' is the last equation's result."""
    for path, n in ((TRAIN, 256), (TEST, 32)):
        recs = read_records(path)
        assert len(recs) == n
        for _, r in recs:
            eqs = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", r["answer"])
            assert eqs, r
            for a, op, b, c in eqs:
                assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b),
                        "/": int(a) / int(b)}[op] == int(c), r
            assert r["answer"].endswith(f"\n#### {eqs[-1][3]}")


def test_chat_prompts_equal_transformers(qwen_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(qwen_dir))
    cfg = PromptDataConfig(train_file=TRAIN, prompt_field="question", system_prompt="Think step by step.")
    ps = load_prompt_set(TRAIN, cfg, load_tokenizer(str(qwen_dir)))
    assert len(ps.prompts) == 256 and ps.n_dropped == 0
    recs = read_records(TRAIN)
    for p, (n, r) in zip(ps.prompts[:20], recs):
        msgs = [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": r["question"]}]
        assert p.ids == hf.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
        assert p.meta["answer"] == r["answer"] and p.meta["source"] == f"{TRAIN}:{n}"


def test_raw_prompts_with_template_and_bos(tmp_path):
    tok = load_tokenizer(None)  # sentencepiece: adds bos
    path = _write(tmp_path / "p.jsonl", [json.dumps({"q": "12+7=", "a": 19, "level": 2}), "",
                                         json.dumps({"q": "5-9=", "a": "-4"})])
    cfg = PromptDataConfig(train_file=path, prompt_field="q", answer_field="a", apply_chat_template=False,
                           prompt_template="sort: {prompt}")
    ps = load_prompt_set(path, cfg, tok)
    assert [p.ids for p in ps.prompts] == [[tok.bos_id, *tok.encode("sort: 12+7=")],
                                           [tok.bos_id, *tok.encode("sort: 5-9=")]]
    assert ps.prompts[0].meta == {"a": 19, "level": 2, "answer": "19", "source": f"{path}:1", "prompt": "sort: 12+7="}
    assert ps.prompts[1].meta["source"] == f"{path}:3"  # blank line 2 skipped, numbering kept


def test_message_list_prompts(qwen_dir, tmp_path):
    tok = load_tokenizer(str(qwen_dir))
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    path = _write(tmp_path / "m.jsonl", [json.dumps({"messages": msgs, "answer": "1"}),
                                         json.dumps({"messages": msgs[1:], "answer": "2"})])
    cfg = PromptDataConfig(train_file=path, prompt_field="messages", system_prompt="Default")
    ps = load_prompt_set(path, cfg, tok)
    assert ps.prompts[0].text == tok.render_chat(msgs)  # its own system turn kept
    assert ps.prompts[1].text == tok.render_chat([{"role": "system", "content": "Default"}, msgs[1]])


def test_length_filter_counts_drops(tmp_path):
    tok = load_tokenizer(None)
    lines = [json.dumps({"prompt": "1" * k, "answer": "x"}) for k in (1, 5, 9, 3, 12)]
    path = _write(tmp_path / "l.jsonl", lines)
    cfg = PromptDataConfig(train_file=path, apply_chat_template=False, max_prompt_tokens=6)  # bos + digits
    ps = load_prompt_set(path, cfg, tok)
    assert [len(p.ids) for p in ps.prompts] == [2, 6, 4] and ps.n_dropped == 2 and ps.n_read == 5
    assert [p.index for p in ps.prompts] == [0, 1, 2]
    assert "2 dropped" in ps.summary()
    with pytest.raises(PromptDataError, match=r"l\.jsonl: all 5 prompts are longer than max_prompt_tokens=1"):
        load_prompt_set(path, PromptDataConfig(train_file=path, apply_chat_template=False, max_prompt_tokens=1), tok)


@pytest.mark.parametrize("content, match", [
    ("", r"e\.jsonl: no records"),
    ("\n\n", r"e\.jsonl: no records"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', r"e\.jsonl:2: malformed JSON"),
    ('["prompt"]\n', r"e\.jsonl:1: expected a JSON object, found list"),
    ('{"prompt": "a", "answer": "1"}\n{"question": "b", "answer": "1"}\n', r"e\.jsonl:2: missing field 'prompt'"),
    ('{"prompt": "a"}\n', r"e\.jsonl:1: missing field 'answer'"),
    ('{"prompt": 7, "answer": "1"}\n', r"e\.jsonl:1: field 'prompt' must be a string or"),
    ('{"prompt": [{"role": "user"}], "answer": "1"}\n', r"e\.jsonl:1: field 'prompt' must be"),
])
def test_bad_files_named(tmp_path, qwen_dir, content, match):
    path = tmp_path / "e.jsonl"
    path.write_text(content, encoding="utf-8")
    cfg = PromptDataConfig(train_file=str(path))
    with pytest.raises(PromptDataError, match=match):
        load_prompt_set(str(path), cfg, load_tokenizer(str(qwen_dir)))
    with pytest.raises(PromptDataError, match="cannot read"):
        read_records(str(tmp_path / "missing.jsonl"))


def test_messages_without_chat_template_refused(tmp_path):
    path = _write(tmp_path / "m.jsonl", [json.dumps({"prompt": [{"role": "user", "content": "x"}], "answer": "1"})])
    cfg = PromptDataConfig(train_file=path, apply_chat_template=False)
    with pytest.raises(PromptDataError, match=r"m\.jsonl:1: field 'prompt' is a list"):
        load_prompt_set(path, cfg, load_tokenizer(None))
    with pytest.raises(PromptDataError, match=r"m\.jsonl: data\.apply_chat_template is true but the tokenizer"):
        load_prompt_set(path, PromptDataConfig(train_file=path), load_tokenizer(None))
    with pytest.raises(PromptDataError, match="system_prompt needs"):
        PromptDataConfig(train_file=path, apply_chat_template=False, system_prompt="x")


def test_parquet_matches_jsonl(tmp_path, qwen_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    recs = [r for _, r in read_records(TEST)]
    pq.write_table(pa.Table.from_pylist(recs), str(tmp_path / "t.parquet"))
    tok = load_tokenizer(str(qwen_dir))
    cfg = PromptDataConfig(train_file=TEST, prompt_field="question")
    a = load_prompt_set(TEST, cfg, tok)
    b = load_prompt_set(str(tmp_path / "t.parquet"), cfg, tok)
    assert [p.ids for p in a.prompts] == [p.ids for p in b.prompts]
    assert b.prompts[3].meta["source"] == f"{tmp_path / 't.parquet'}:4"
    pq.write_table(pa.Table.from_pylist([{"question": "x"}]), str(tmp_path / "n.parquet"))
    with pytest.raises(PromptDataError, match=r"n\.parquet:1: missing field 'answer'"):
        load_prompt_set(str(tmp_path / "n.parquet"), cfg, tok)


def _reference_order(n, B, seed, shuffle, epochs, steps):
    """A hand-written stream: epochs of numpy permutations, cut into batches of B."""
    stream = []
    for e in range(epochs):
        stream += list(np.random.default_rng([seed, e]).permutation(n)) if shuffle else list(range(n))
    return [stream[s * B:(s + 1) * B] for s in range(steps)]


@pytest.mark.parametrize("n, B, epochs, shuffle", [(10, 4, 3, True), (7, 7, 2, True), (9, 2, 1, False)])
def test_order_is_global_and_layout_independent(n, B, epochs, shuffle):
    s = PromptSampler(n, B, seed=3, shuffle=shuffle, epochs=epochs)
    assert s.num_steps == epochs * n // B
    ref = _reference_order(n, B, 3, shuffle, epochs, s.num_steps)
    for step in range(s.num_steps):
        assert s.global_indices(step) == ref[step]
        for dp in [d for d in (1, 2, 4, 7) if B % d == 0]:
            assert sum((s.rank_indices(step, r, dp) for r in range(dp)), []) == ref[step]
    counts = np.bincount(sum(ref, []), minlength=n)
    assert counts.max() - counts.min() <= 1  # every prompt used once per epoch
    assert PromptSampler(n, B, seed=4, epochs=epochs).global_indices(0) != ref[0] or not shuffle or n < 3
    with pytest.raises(PromptDataError, match="past the data"):
        s.global_indices(s.num_steps)


def test_sampler_errors_and_resume_check():
    s = PromptSampler(10, 4, seed=1)
    with pytest.raises(PromptDataError, match="multiple of dp=3"):
        s.rank_indices(0, 0, 3)
    s.check_state(PromptSampler(10, 4, seed=1).state_dict())
    with pytest.raises(PromptDataError, match="seed or shuffle changed"):
        s.check_state(PromptSampler(10, 4, seed=2).state_dict())
    assert sum((eval_rank_indices(11, r, 4) for r in range(4)), []) == list(range(11))


def test_eval_holdout_and_eval_file(qwen_dir):
    tok = load_tokenizer(str(qwen_dir))
    cfg = PromptDataConfig(train_file=TRAIN, prompt_field="question", eval_holdout=16, seed=5)
    train, ev = load_prompt_data(cfg, tok)
    assert len(train.prompts) == 240 and len(ev.prompts) == 16
    src = lambda ps: {p.meta["source"] for p in ps.prompts}  # noqa: E731
    assert not src(train) & src(ev) and len(src(train) | src(ev)) == 256
    assert src(load_prompt_data(cfg, tok)[1]) == src(ev)  # seeded
    train2, ev2 = load_prompt_data(PromptDataConfig(train_file=TRAIN, prompt_field="question", eval_file=TEST), tok)
    assert len(train2.prompts) == 256 and len(ev2.prompts) == 32
    with pytest.raises(PromptDataError, match="leaves no training records"):
        load_prompt_data(PromptDataConfig(train_file=TEST, prompt_field="question", eval_holdout=32), tok)


def test_encoding_256_prompts_is_fast(qwen_dir):
    """Rendering + batch-encoding a step's 256 chat prompts stays far below a training step (tens of ms)."""
    tok = load_tokenizer(str(qwen_dir))
    cfg = PromptDataConfig(train_file=TRAIN, prompt_field="question", system_prompt="Think step by step.")
    records = read_records(TRAIN)
    load_prompt_set(TRAIN, cfg, tok, records)  # warm the template cache
    t0 = time.perf_counter()
    ps = load_prompt_set(TRAIN, cfg, tok, records)
    dt = time.perf_counter() - t0
    assert len(ps.prompts) == 256
    assert dt < 1.0, dt  # measured ~0.03 s on 2 loaded cores
