"""HF tokenizer.json tokenizers and chat templates against transformers.AutoTokenizer: ids, decode and
chat renderings equal on a few hundred strings (Qwen2-style and Llama-3-style byte-level BPEs trained
by tools.train_tokenizer on the shipped corpus); eos ids, bos and errors read from the files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.tokenizer import DEFAULT_CORPUS, TokenizerError, load_tokenizer
from tests.dist import REPO
from tools.train_tokenizer import train_hf_tokenizer

transformers = pytest.importorskip("transformers")

SPECIALS = {"qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "llama3": ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|reserved_special_token_0|>"]}
FIXED = ["", " ", "   ", "\n", "\n\n\t \n", "hello world", "Hello,  World!!", "  leading and trailing  ",
         "12345678901234567890", "3.14159 + 2,718 = 5.86", "x=1;y=22;z=333", "naïve café résumé", "Ａｂｃ１２３",
         "你好，世界！这是一个测试。", "日本語のテキスト", "한국어 텍스트", "😀🎉👍🏽 emoji 🇫🇷", "e\u0301 vs é",
         "tabs\tand\r\nCRLF", "I'm you're they'll we'd IT'S", "#### 42", "\\boxed{\\frac{1}{2}}",
         "<|im_end|>", "text<|im_start|>user\nhi<|im_end|>\n", "<|eot_id|><|eot_id|>", "<|endoftext", "<|im_end|x",
         "<|begin_of_text|>Hi", "a <|end_header_id|> b", "\u200b\u00a0\ufeff", "\x00\x01", "ß" * 30]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  padded question  "}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
     {"role": "user", "content": "Q2 你好 😀"}],
    [{"role": "user", "content": "multi\nline\n\n content"}, {"role": "assistant", "content": "#### 7"}],
]


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    train_hf_tokenizer(DEFAULT_CORPUS, str(d), 400, request.param)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    return request.param, load_tokenizer(str(d)), hf, d


def _check_same(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False), text
    assert ours.decode(ids) == hf.decode(ids), text
    return ids


@pytest.mark.parametrize("i", range(len(FIXED)))
def test_fixed_strings_match_autotokenizer(pair, i):
    style, ours, hf, _ = pair
    ids = _check_same(ours, hf, FIXED[i])
    if style == "llama3":  # no normaliser: byte-level BPE decodes back to the exact text
        assert ours.decode(ids) == FIXED[i]


_alphabet = st.sampled_from(list("abcXYZ019 \t\n\r.,!?'#$%\\{}()-+=_") + ["é", "ß", "你", "好", "😀", "🇯🇵", "\u0301",
                                                                      "\u00a0", "  ", "123", "'s", "<|", "|>"])
_special = st.sampled_from(sum(SPECIALS.values(), []))
_text = st.lists(st.one_of(_alphabet, _special, st.text(max_size=3)), max_size=20).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(_text, min_size=1, max_size=4))
def test_random_strings_match_autotokenizer(pair, texts):
    _, ours, hf, _ = pair
    batch = ours.encode_batch(texts)
    for t, ids in zip(texts, batch):
        assert ids == _check_same(ours, hf, t)


def test_special_token_strings_in_text_become_their_ids(pair):
    style, ours, _, _ = pair
    for s in SPECIALS[style]:
        assert ours.encode(s) == [ours.piece_to_id(s)]
        assert ours.decode(ours.encode("a" + s + "b")) == "a" + s + "b"


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("c", range(len(CHATS)))
def test_chat_rendering_matches_apply_chat_template(pair, c, gen):
    _, ours, hf, _ = pair
    want = hf.apply_chat_template(CHATS[c], tokenize=False, add_generation_prompt=gen)
    assert ours.render_chat(CHATS[c], add_generation_prompt=gen) == want
    ids = hf.apply_chat_template(CHATS[c], tokenize=True, add_generation_prompt=gen, return_dict=False)
    assert ours.encode_chat(CHATS[c], add_generation_prompt=gen) == list(ids)


def test_special_ids_from_the_config_files(pair):
    style, ours, hf, d = pair
    gen = json.loads((d / "generation_config.json").read_text())
    assert ours.eos_ids[0] == hf.eos_token_id and set(ours.eos_ids) == set(gen["eos_token_id"])
    assert len(ours.eos_ids) == (2 if style == "qwen2" else 3)
    assert ours.bos_id == hf.bos_token_id  # None for qwen2
    assert ours.pad_id == (hf.pad_token_id if style == "qwen2" else None)
    assert ours.vocab_size == len(hf)
    assert ours.adds_bos == (hf.encode("a")[0] == hf.bos_token_id if hf.bos_token_id is not None else False)


def test_template_environment_matches_transformers(pair):
    """tojson (no HTML escaping, unicode kept), namespace, loop controls, raise_exception, generation block,
    special-token variables and whitespace trimming, each against transformers' renderer."""
    _, ours, hf, _ = pair
    tpl = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
           "{% set ns.n = ns.n + 1 %}\n  {{ m | tojson }}|{{ m.content | tojson(indent=2) }}\n"
           "{% generation %}[{{ eos_token }}]{% endgeneration %}{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}")
    msgs = [{"role": "user", "content": "<b>&'\"é😀"}, {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "ok", "extra": None}]
    saved = ours.chat_template, hf.chat_template
    ours.chat_template, hf.chat_template = tpl, tpl
    try:
        assert ours.render_chat(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        bad = "{{ raise_exception('no system role allowed') }}"
        ours.chat_template = bad
        with pytest.raises(TokenizerError, match=r"tokenizer_config\.json.*no system role allowed"):
            ours.render_chat(msgs)
        ours.chat_template = "{% for %}"
        with pytest.raises(TokenizerError, match=r"tokenizer_config\.json.*does not compile"):
            ours.render_chat(msgs)
    finally:
        ours.chat_template, hf.chat_template = saved


def test_fingerprint_hashes_the_files(pair, tmp_path):
    _, ours, _, d = pair
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    assert load_tokenizer(str(copy)).fingerprint == ours.fingerprint  # path independent
    shutil.copyfile(copy / "tokenizer.json", copy / "renamed.json")
    assert load_tokenizer(str(copy / "renamed.json")).fingerprint == ours.fingerprint  # file name independent
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] += " "
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(str(copy)).fingerprint != ours.fingerprint


def test_undecodable_id_refused(pair):
    _, ours, _, _ = pair
    with pytest.raises(ValueError, match=r"id 100000 is outside the vocabulary .*tokenizer\.json"):
        ours.decode([5, 100000])


def test_decode_batch_matches_batch_decode(pair):
    """Tokenizer.decode_batch (one backend call, the rollout's) against transformers' batch_decode."""
    _, ours, hf, _ = pair
    batch = [ours.encode(t) for t in FIXED] + [[]]
    assert ours.decode_batch(batch) == hf.batch_decode(batch) == [ours.decode(b) for b in batch]
    with pytest.raises(ValueError, match=r"id 100000 is outside the vocabulary .*tokenizer\.json"):
        ours.decode_batch([[5], [5, 100000]])


def test_errors_name_the_file(pair, tmp_path):
    _, _, _, d = pair
    for name, content, match in [
            ("tokenizer.json", "{not json", r"bad/tokenizer\.json: not a valid"),
            ("tokenizer_config.json", "[1]", r"bad/tokenizer_config\.json: expected a JSON object"),
            ("tokenizer_config.json", json.dumps({"eos_token": "<|nope|>"}),
             r"bad/tokenizer_config\.json: key 'eos_token' names '<\|nope\|>'"),
            ("generation_config.json", json.dumps({"eos_token_id": [1, 10**6]}),
             r"bad/generation_config\.json: key 'eos_token_id'")]:
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(d, bad)
        (bad / name).write_text(content)
        with pytest.raises(TokenizerError, match=match):
            load_tokenizer(str(bad))
    with pytest.raises(TokenizerError, match="without tokenizer.json or tokenizer.model"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_no_chat_template_named(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: no chat_template"):
        load_tokenizer(None).render_chat([{"role": "user", "content": "x"}])


def test_cli_hf_style(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.train_tokenizer", "--input", DEFAULT_CORPUS, "--vocab-size",
                        "300", "--hf-style", "qwen2", "--out", str(tmp_path / "q")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    tok = load_tokenizer(str(tmp_path / "q"))
    assert tok.vocab_size == 303 and tok.decode(tok.encode("12+7=19")) == "12+7=19"
    r = subprocess.run([sys.executable, "-m", "tools.train_tokenizer", "--input", DEFAULT_CORPUS, "--vocab-size",
                        "200", "--hf-style", "qwen2", "--out", str(tmp_path / "x")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "256 byte pieces" in r.stderr


_role_turns = st.lists(st.tuples(st.sampled_from(["user", "assistant"]), _text), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=st.one_of(st.none(), _text), turns=_role_turns, gen=st.booleans())
def test_random_chats_match_apply_chat_template(pair, system, turns, gen):
    _, ours, hf, _ = pair
    chat = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": r, "content": c} for r, c in turns]
    want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert ours.render_chat(chat, add_generation_prompt=gen) == want
    assert ours.encode_chat(chat, add_generation_prompt=gen) == list(
        hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False))
