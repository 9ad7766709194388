"""tools.convert_hf carries the tokenizer: import copies the tokenizer files and generation_config.json
into the checkpoint (sha256 in its manifest, checked with hashlib), load_tokenizer(checkpoint) reads
them; export writes them back and transformers loads model and tokenizer from the exported folder."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from core.ckpt import read_manifest
from core.tokenizer import DEFAULT_CORPUS, DEFAULT_TOKENIZER, load_tokenizer
from tools.convert_hf import ConvertError, export_hf, import_hf, main
from tools.train_tokenizer import train_hf_tokenizer

transformers = pytest.importorskip("transformers")

TOKENIZER_NAMES = ["generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random Qwen2-architecture checkpoint whose embedding (320 rows) is larger than its tokenizer (303)."""
    d = tmp_path_factory.mktemp("qwen2_hf")
    train_hf_tokenizer(DEFAULT_CORPUS, str(d), 300, "qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    cfg = transformers.Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    gen = (d / "generation_config.json").read_bytes()  # two EOS ids; save_pretrained writes the model's one
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(str(d))
    (d / "generation_config.json").write_bytes(gen)
    return d


def test_import_copies_and_hashes_tokenizer_files(hf_dir, tmp_path):
    out = tmp_path / "ckpt"
    import_hf(str(hf_dir), str(out))
    m = read_manifest(str(out))
    for name in TOKENIZER_NAMES:
        assert m["files"][name] == _sha(hf_dir / name), name
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes()
    ours, src = load_tokenizer(str(out)), load_tokenizer(str(hf_dir))
    assert m["tokenizer_fingerprint"] == ours.fingerprint == src.fingerprint
    assert ours.eos_ids == src.eos_ids and len(ours.eos_ids) == 2
    chat = [{"role": "user", "content": "What is 3+4?"}]
    assert ours.render_chat(chat) == src.render_chat(chat)


def test_export_round_trips_to_transformers(hf_dir, tmp_path):
    out, back = tmp_path / "ckpt", tmp_path / "back"
    assert main(["import", "--hf-dir", str(hf_dir), "--out", str(out)]) == 0
    assert main(["export", "--ckpt", str(out), "--hf-dir", str(back)]) == 0
    for name in TOKENIZER_NAMES:
        assert (back / name).read_bytes() == (hf_dir / name).read_bytes(), name
    want = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    got = transformers.AutoTokenizer.from_pretrained(str(back))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7=? 你好"}]
    assert got.apply_chat_template(chat, tokenize=False) == want.apply_chat_template(chat, tokenize=False)
    assert got.encode("sort: c a b -> a b c") == want.encode("sort: c a b -> a b c")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(back))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
    ids = torch.tensor([want.encode("12+7=19")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert list(model.generation_config.eos_token_id) == json.loads(
        (hf_dir / "generation_config.json").read_text())["eos_token_id"]


def test_export_takes_tokenizer_from_another_folder(hf_dir, tmp_path):
    bare = tmp_path / "bare"  # the weights only, as a trainer checkpoint without tokenizer files
    shutil.copytree(hf_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special*", "generation*"))
    import_hf(str(bare), str(tmp_path / "ckpt"))
    assert read_manifest(str(tmp_path / "ckpt"))["tokenizer_fingerprint"] is None
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), tokenizer_dir=str(hf_dir))
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back")).encode("hi") == \
        transformers.AutoTokenizer.from_pretrained(str(hf_dir)).encode("hi")


def test_sentencepiece_fingerprint_unchanged(hf_dir, tmp_path):
    """A checkpoint with only tokenizer.model keeps the sentencepiece fingerprint (sha256 of the model file)."""
    sp = tmp_path / "sp"
    shutil.copytree(hf_dir, sp, ignore=shutil.ignore_patterns("tokenizer*", "special*"))
    shutil.copyfile(DEFAULT_TOKENIZER, sp / "tokenizer.model")
    (sp / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    import_hf(str(sp), str(tmp_path / "ckpt"))
    m = read_manifest(str(tmp_path / "ckpt"))
    with open(DEFAULT_TOKENIZER, "rb") as f:
        assert m["tokenizer_fingerprint"] == hashlib.sha256(f.read()).hexdigest() == m["files"]["tokenizer.model"]
    assert load_tokenizer(str(tmp_path / "ckpt")).eos_ids == [2, 3]  # the model's eos, then the extra one


def test_bad_tokenizer_file_named(hf_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    (bad / "tokenizer_config.json").write_text('{"eos_token": "<|missing|>"}')
    with pytest.raises(ConvertError, match=r"bad/tokenizer_config\.json: key 'eos_token'"):
        import_hf(str(bad), str(tmp_path / "ckpt"))
