"""`Tokenizer.render_chat` with tools, documents and reasoning against transformers'
`apply_chat_template(tokenize=False)` (and tokenize=True for the ids) on the same templates: Qwen2.5-,
Llama-3.1-, DeepSeek-R1-, gpt-oss- and RAG-style templates (tests/chat_templates.py) rendered by both."""

from __future__ import annotations

import pytest

from core.tokenizer import DEFAULT_CORPUS, TokenizerError, load_tokenizer
from tests.chat_templates import ADD, CHATS, DOCS, TEMPLATES, WEATHER
from tools.train_tokenizer import train_hf_tokenizer

transformers = pytest.importorskip("transformers")

CASES = [  # (template, chat, keywords for both renderers)
    *[("qwen2.5_tools", c, {"tools": [WEATHER, ADD]}) for c in ("plain", "system", "tool_round")],
    ("qwen2.5_tools", "tool_round", {}),
    *[("llama3.1_tools", c, {"tools": [WEATHER, ADD]}) for c in ("plain", "system", "tool_round")],
    ("llama3.1_tools", "system", {"tools": [WEATHER], "tools_in_user_message": False, "date_string": "2 Dec 2026"}),
    ("llama3.1_tools", "plain", {}),
    *[("r1_reasoning", c, {}) for c in ("thinking", "reasoning_content", "reasoning", "plain")],
    ("r1_reasoning", "plain", {"enable_thinking": False}),
    *[("thinking_field", c, {}) for c in ("thinking", "reasoning_content", "plain")],
    ("rag_documents", "system", {"documents": DOCS}),
    ("rag_documents", "plain", {"documents": DOCS, "tools": [ADD]}),
    ("rag_documents", "plain", {}),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    train_hf_tokenizer(DEFAULT_CORPUS, str(d), 400, "qwen2")
    return load_tokenizer(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("name,chat,kw", CASES, ids=[f"{t}-{c}-{'+'.join(k) or 'none'}" for t, c, k in CASES])
def test_render_chat_matches_apply_chat_template(pair, name, chat, kw, gen):
    ours, hf = pair
    ours.chat_template = hf.chat_template = TEMPLATES[name]
    want = hf.apply_chat_template(CHATS[chat], tokenize=False, add_generation_prompt=gen, **kw)
    assert ours.render_chat(CHATS[chat], add_generation_prompt=gen, **kw) == want
    ids = hf.apply_chat_template(CHATS[chat], tokenize=True, add_generation_prompt=gen, return_dict=False, **kw)
    assert ours.encode_chat(CHATS[chat], add_generation_prompt=gen, **kw) == list(ids)


def test_reasoning_reaches_the_template(pair):
    """The rendering holds the thinking text (not only equal to transformers: present at all)."""
    ours, _ = pair
    ours.chat_template = TEMPLATES["r1_reasoning"]
    assert "<think>\n2+2=4\n</think>\n\n#### 4" in ours.render_chat(CHATS["thinking"], add_generation_prompt=False)
    ours.chat_template = TEMPLATES["qwen2.5_tools"]
    assert '"name": "get_weather"' in ours.render_chat(CHATS["plain"], tools=[WEATHER])


def test_messages_are_not_modified(pair):
    ours, _ = pair
    ours.chat_template = TEMPLATES["r1_reasoning"]
    chat = [dict(m) for m in CHATS["thinking"]]
    ours.render_chat(chat)
    assert chat == CHATS["thinking"]


@pytest.mark.parametrize("kw,msg", [({"tools": WEATHER}, r"tools must be a list of dicts, got a dict"),
                                    ({"tools": [print]}, r"tools\[0\] is a builtin_function_or_method"),
                                    ({"documents": ["text"]}, r"documents\[0\] is a str")])
def test_bad_tools_and_documents_are_named(pair, kw, msg):
    ours, _ = pair
    ours.chat_template = TEMPLATES["rag_documents"]
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: " + msg):
        ours.render_chat(CHATS["plain"], **kw)
