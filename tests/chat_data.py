"""Chat test data: tokenizer folders with real chat templates (written here as data: a Llama 3
and a Qwen3 style template) and conversation files, built locally (nothing downloaded)."""

from __future__ import annotations

import json
import os

from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH

# Meta-Llama-3-8B-Instruct's chat_template (tokenizer_config.json), verbatim
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Qwen3's chat_template without the tool-calling branches: ChatML turns, and the reasoning
# block (<think>) kept only for assistant turns after the last user query
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

STYLES = {
    # specials added to the shipped BPE, then tokenizer_config.json's bos/eos/pad
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE},
    ),
    "qwen3": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": QWEN3_TEMPLATE},
    ),
}


def tokenizer_folder(folder, style: str) -> str:
    """The shipped BPE plus ``style``'s special tokens and template, saved in ``folder``."""
    from tokenizers import AddedToken, Tokenizer

    specials, config = STYLES[style]
    tok = Tokenizer.from_file(DEFAULT_TOKENIZER_PATH)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **{k: v for k, v in config.items() if v is not None}}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


def conversations(n: int, seed: int = 0, *, short_every: int = 0) -> list[list[dict]]:
    """``n`` conversations (system on every third, 1-3 user/assistant exchanges); with
    ``short_every`` every such conversation is one tiny exchange (its targets sit at the
    window's start: CP chunks further on hold none)."""
    import random

    rng = random.Random(seed)
    words = "alpha beta gamma delta echo fox golf hotel india julia kilo lima mike nova oscar".split()

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    out = []
    for i in range(n):
        if short_every and i % short_every == 0:
            out.append([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
            continue
        msgs = [{"role": "system", "content": text(3)}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):
            msgs += [{"role": "user", "content": text(rng.randint(1, 6))}]
            msgs += [{"role": "assistant", "content": text(rng.randint(1, 8))}]
        out.append(msgs)
    return out


def write_jsonl(path, convs) -> str:
    with open(path, "w") as f:
        for msgs in convs:
            f.write(json.dumps({"messages": msgs}) + "\n")
    return str(path)


def write_parquet(path, rows: dict, row_group_size: int = 16) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(rows), str(path), row_group_size=row_group_size)
    return str(path)
