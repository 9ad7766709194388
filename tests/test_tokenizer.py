"""The shipped tokenizer and the training tool, checked against the raw text and hashlib."""

import hashlib
import os
import subprocess
import sys

import pytest

from core.tokenizer import DEFAULT_CORPUS, DEFAULT_TOKENIZER, TokenizerError, load_tokenizer
from tests.dist import REPO

TASK_STRINGS = [
    "12+7=19", "44-89=-45", "0+0=0", "sort: c a b -> a b c", "sort: z,z,w,y -> w,y,z,z",
    "sort: 40,9,35 -> 9,35,40", "abcdefghijklmnopqrstuvwxyz", "0123456789", " a  b ", "",
]


def test_shipped_ids_and_size():
    tok = load_tokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert 256 <= tok.vocab_size <= 512
    assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]


@pytest.mark.parametrize("text", TASK_STRINGS)
def test_task_strings_round_trip_without_unk(text):
    tok = load_tokenizer()
    ids = tok.encode(text)
    assert tok.unk_id not in ids
    assert tok.decode(ids) == text
    assert tok.encode(text, bos=True, eos=True) == [tok.bos_id, *ids, tok.eos_id]
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text


def test_concatenated_pieces_decode_to_concatenated_text():
    # prompts and responses are encoded separately: no dummy-prefix space may appear between them
    tok = load_tokenizer()
    for a, b in [("12+7=", "19"), ("sort: c a b ->", " a b c"), ("The cat", " sees.")]:
        assert tok.decode(tok.encode(a) + tok.encode(b)) == a + b


def test_digits_are_single_tokens():
    tok = load_tokenizer()
    assert len(tok.encode("1234567890")) == 10


def test_shipped_corpus_round_trips():
    tok = load_tokenizer()
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) > 300
    for line in lines:
        ids = tok.encode(line)
        assert tok.unk_id not in ids, line
        assert tok.decode(ids) == line


def test_fingerprint_is_sha256_of_the_model_file():
    with open(DEFAULT_TOKENIZER, "rb") as f:
        expected = hashlib.sha256(f.read()).hexdigest()
    assert load_tokenizer().fingerprint == expected
    assert load_tokenizer(DEFAULT_TOKENIZER).fingerprint == expected


def test_unknown_character_maps_to_unk_and_bad_ids_refused():
    tok = load_tokenizer()
    assert tok.encode("\u00e9") == [tok.unk_id]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_bad_tokenizer_file_named(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a sentencepiece proto")
    with pytest.raises(TokenizerError, match="bad.model"):
        load_tokenizer(str(bad))
    with pytest.raises(TokenizerError, match="missing.model"):
        load_tokenizer(str(tmp_path / "missing.model"))


def test_cli_rebuilds_the_shipped_model_byte_for_byte(tmp_path):
    out = tmp_path / "sub" / "tok"
    r = subprocess.run([sys.executable, "-m", "tools.train_tokenizer", "--input", DEFAULT_CORPUS,
                        "--vocab-size", "256", "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with open(DEFAULT_TOKENIZER, "rb") as f:
        shipped = f.read()
    assert (tmp_path / "sub" / "tok.model").read_bytes() == shipped  # deterministic, path independent
    vocab_lines = (tmp_path / "sub" / "tok.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == 256 and vocab_lines[0].startswith("<pad>\t")


def test_cli_small_custom_vocab(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world\nsort: b a -> a b\n1+2=3\n" * 20, encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "tools.train_tokenizer", "--input", str(text),
                        "--vocab-size", "40", "--out", str(tmp_path / "small")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    tok = load_tokenizer(str(tmp_path / "small.model"))
    assert tok.vocab_size == 40
    assert tok.decode(tok.encode("sort: b a -> a b")) == "sort: b a -> a b"
    assert os.path.getsize(tmp_path / "small.model") > 0


def test_cli_reports_impossible_vocab(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.train_tokenizer", "--input", DEFAULT_CORPUS,
                        "--vocab-size", "256", "--byte-fallback", "--out", str(tmp_path / "x")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "vocab" in r.stderr.lower()
    assert not (tmp_path / "x.model").exists()
