# ruff: noqa: E501 - templates are kept as published, one Jinja statement a line
"""Chat templates in the style of published checkpoints that read `tools`, `documents` and a message's
reasoning (written here: no hub access), for the tests that render them against transformers."""

# Qwen2.5 Instruct: tools listed in the system turn inside <tools></tools>, tool calls and responses as XML.
QWEN25_TOOLS = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nReturn each call as <tool_call>\n{\"name\": <name>, \"arguments\": <json>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama 3.1 Instruct: defaults set with `is defined`, tools as indented JSON in the first user turn
# (or the system turn), a date_string variable, tool calls as {"name", "parameters"}, ipython turns.
LLAMA31_TOOLS = r"""{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, respond with a JSON for a function call.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# DeepSeek-R1 / Qwen3 style: an assistant turn's reasoning_content inside <think>, kept only for the last
# turn; enable_thinking=False closes an empty think block in the generation prompt.
R1_REASONING = r"""{%- for message in messages %}
    {%- if message.role == 'system' %}{{- message.content }}
    {%- elif message.role == 'user' %}{{- '<|User|>' + message.content }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if message.reasoning_content is defined and loop.last %}
            {%- set content = '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' + content %}
        {%- endif %}
        {{- '<|Assistant|>' + content + eos_token }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|Assistant|>' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}"""

# gpt-oss style: reads a message's `thinking` (filled from reasoning_content when only that is given).
THINKING_FIELD = r"""{%- for message in messages %}
<|start|>{{ message.role }}{% if message.thinking is defined %}<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{% endif %}<|message|>{{ message.content }}<|end|>
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

# Retrieval-augmented (Command-R / Granite style): documents listed in a system turn before the chat.
RAG_DOCUMENTS = r"""{%- if documents %}
<|im_start|>system
Answer from these documents:
{%- for d in documents %}

[{{ loop.index }}] {{ d.title }}
{{ d.text }}
{%- endfor %}
<|im_end|>
{% endif %}
{%- for message in messages %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

TEMPLATES = {"qwen2.5_tools": QWEN25_TOOLS, "llama3.1_tools": LLAMA31_TOOLS, "r1_reasoning": R1_REASONING,
             "thinking_field": THINKING_FIELD, "rag_documents": RAG_DOCUMENTS}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current temperature at a place. <b>&'\"é",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "number"}, "b": {"type": "number"}}}}}
DOCS = [{"title": "GSM8K", "text": "Grade-school math, 8.5k problems."},
        {"title": "Café 😀", "text": "multi\nline\ntext"}]

CHATS = {
    "plain": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}],
    "tool_round": [
        {"role": "user", "content": "Weather in Paris, then add 2 and 3."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]},
        {"role": "tool", "name": "get_weather", "content": "21"},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "21 C; 5."},
        {"role": "user", "content": "thanks"}],
    "thinking": [{"role": "user", "content": "Q1"},
                 {"role": "assistant", "content": "A1", "thinking": "first think"},
                 {"role": "user", "content": "Q2"},
                 {"role": "assistant", "content": "#### 4", "thinking": "\n2+2=4\n"}],
    "reasoning_content": [{"role": "user", "content": "Q"},
                          {"role": "assistant", "content": "A", "reasoning_content": "because", "extra": None}],
    "reasoning": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning": "r"}],
}
