"""Rendering a checkpoint's Jinja `chat_template` exactly as `transformers.apply_chat_template` does.

The environment matches transformers': an `ImmutableSandboxedEnvironment` (templates from the Hub
are untrusted code) with `trim_blocks` and `lstrip_blocks` on and the `loopcontrols` extension;
`tojson` replaced by a json.dumps that does not escape HTML (ensure_ascii=False, optional indent /
separators / sort_keys); the globals `raise_exception(msg)` (raises), `strftime_now(fmt)`, `dict`
and `namespace` (refusing underscore-prefixed names); and the `{% generation %}...{% endgeneration %}`
block (used by templates that mark assistant tokens), which here renders its body unchanged.

Variables: `messages` (None-valued keys dropped; a message's reasoning, given as `reasoning_content`,
`thinking` or `reasoning`, is visible under both `reasoning_content` and `thinking`, as transformers 5
does), `add_generation_prompt`, `tools` (a list of JSON-schema dicts, or None), `documents` (a list of
dicts, or None), the tokenizer's named special tokens as strings (`bos_token`, `eos_token`,
`unk_token`, `pad_token`, ... where set), then any caller `**kwargs` (which win over the special
tokens), e.g. `enable_thinking=False` or `date_string=...` for templates that read them.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template that does not compile or raised while rendering; the message names the file."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}`: renders `body` (assistant-mask tracking is not needed)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _SafeDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace`, refusing attribute names that start with an underscore."""

    def __init__(*args, **kwargs):  # noqa: N805 - the same signature trick as jinja2.utils.Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template: namespace attribute {name!r} starts with '_'")


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source); raises jinja2.TemplateSyntaxError on bad syntax."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_SafeDict(),
                       namespace=_SafeNamespace)
    return env.from_string(source)


def _plain(value):
    """A deep copy of JSON-like data (dicts, lists, tuples, str, numbers, bools, None); anything else refused."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"chat messages may hold only JSON-like data, found a {type(value).__name__}")


# Names a message's reasoning comes under; templates read the first (DeepSeek-R1, Qwen3) or "thinking".
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning_aliases(message: dict) -> dict:
    """`message` with its reasoning (the first of REASONING_FIELDS set) under reasoning_content and thinking."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _dict_list(value, name: str, where: str) -> list | None:
    """`tools` / `documents`: None or a list of dicts (JSON schemas, {"title", "text"} records)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ChatTemplateError(f"{where}: {name} must be a list of dicts, got a {type(value).__name__}")
    for i, v in enumerate(value):
        if not isinstance(v, dict):
            raise ChatTemplateError(f"{where}: {name}[{i}] is a {type(v).__name__}, expected a dict"
                                    + (" (a JSON schema; callables are not converted)" if name == "tools" else ""))
    return _plain(list(value))


def render_chat_template(source: str, messages: list[dict], *, add_generation_prompt: bool = True,
                         tools: list[dict] | None = None, documents: list[dict] | None = None,
                         special_tokens: dict | None = None, where: str = "chat_template", **kwargs) -> str:
    """Render `source` for one conversation, with optional `tools` (JSON schemas) and `documents`
    ({"title", "text"} dicts). `where` (e.g. the tokenizer_config.json path) names the template in
    errors; a `raise_exception` call in the template becomes a ChatTemplateError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(f"{where}: a chat is a non-empty list of message dicts, got {messages!r:.80}")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"{where}: message {i} is a {type(m).__name__}, expected a dict")
        chat.append(_with_reasoning_aliases({k: _plain(v) for k, v in m.items() if v is not None}))
    try:
        template = compile_chat_template(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: chat_template does not compile (line {e.lineno}: {e.message})") from e
    tools, documents = _dict_list(tools, "tools", where), _dict_list(documents, "documents", where)
    variables = {**(special_tokens or {}), **_plain(kwargs)}
    try:
        return template.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"{where}: chat_template failed: {e}") from e
