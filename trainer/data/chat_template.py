"""Chat templates: a conversation (``messages``: role, content) -> token ids and the assistant
target mask, as Hugging Face transformers renders it.

The template is the model's own: ``chat_template`` in the ``tokenizer_config.json`` (or a
``chat_template.jinja`` file) next to the run's ``tokenizer.json``; the shipped tokenizer, which
has none, uses :data:`BUILTIN_TEMPLATE`. It is rendered with ``jinja2`` exactly as transformers'
``apply_chat_template`` does (a sandboxed environment with ``trim_blocks``, ``lstrip_blocks``,
the ``loopcontrols`` extension, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``;
the variables ``messages``, ``add_generation_prompt`` and the special tokens ``bos_token``,
``eos_token``, ``pad_token``) and the text tokenized with special-token text parsed, so the ids
equal ``apply_chat_template(messages, tokenize=True)`` token for token.

Which tokens are targets. For each assistant message i, the conversation up to message i
rendered with ``add_generation_prompt=True`` must be a prefix of the whole conversation's text
(true of the Llama 3, ChatML/Qwen and the built-in templates): the assistant turn starts where
that prefix ends (after the ``assistant`` header). It ends after the turn's end-of-turn marker:
the special token that ends the rendering of messages ``[0, i]`` (``<|eot_id|>``, ``<|im_end|>``,
``<|eos|>``), looked up from the turn's start; a template without one ends the turn where that
rendering ends. A token is a target when its text starts inside an assistant turn.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from trainer.config import ConfigError
from trainer.data.tokenizer import read_json_config

__all__ = ["BUILTIN_TEMPLATE", "ROLES", "ChatTemplate", "load_chat_template"]

ROLES = ("system", "user", "assistant")

# The shipped tokenizer's template: role markers as text, every message ended by <|eos|>.
BUILTIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatError(ValueError):
    """A conversation or template the trainer cannot train on (bad input: one line, exit 2)."""


def _environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_template(folder: str) -> tuple[str | None, str]:
    """(template, where it came from) from a tokenizer folder; (None, '') when it has none."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), jinja_file
    config = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config):
        template = read_json_config(config).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            return template, config
    return None, ""


class ChatTemplate:
    """A compiled chat template bound to a tokenizer (which must offer ``encode_chat``)."""

    def __init__(self, source: str, where: str, tokenizer):
        import jinja2

        self.source, self.where, self.tokenizer = source, where, tokenizer
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"chat template from {where} does not compile: {exc}; fix the template") from None
        name = getattr(tokenizer, "token_text", lambda _i: None)
        self.special = {k: name(getattr(tokenizer, f"{k}_id", None)) or "" for k in ("bos", "eos", "pad")}
        texts = getattr(tokenizer, "special_token_texts", lambda: [])()
        self._specials = sorted(texts, key=len, reverse=True)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``; a :class:`ChatError` naming the template when
        it fails. A template is code: besides ``jinja2.TemplateError`` (``raise_exception``,
        undefined names, the sandbox's refusals) it can raise whatever Python raises (a
        TypeError, a ZeroDivisionError, the sandbox's ``range`` limit, unbounded recursion),
        all of them the template's failure on this input, not the trainer's."""
        import jinja2

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.special["bos"],
                eos_token=self.special["eos"],
                pad_token=self.special["pad"],
            )
        except jinja2.TemplateError as exc:
            raise ChatError(f"the chat template ({self.where}) failed to render it: {exc}") from None
        except Exception as exc:  # the template's own code failed (any Python error)
            detail = " ".join(str(exc).split()).rstrip(".") or "no message"
            raise ChatError(
                f"the chat template ({self.where}) failed to render it: {type(exc).__name__}: {detail}; fix the template"
            ) from None

    def _turn_end(self, full: str, start: str, upto: str) -> int:
        tail = upto.rstrip()
        if len(tail) <= len(start):  # the template wrote nothing for this assistant message
            return len(start)
        for special in self._specials:
            if tail.endswith(special):
                at = full.find(special, len(start))
                if at >= 0:
                    return at + len(special)
        if not full.startswith(upto):
            raise ChatError("the chat template renders a conversation's beginning differently from the whole")
        return len(tail)

    def encode(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        """(token ids, is-target per token) of one conversation; :class:`ChatError` when a
        message is malformed or the template fails on it."""
        check_messages(messages)
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self.render(messages[:i], add_generation_prompt=True)
            if not full.startswith(start):
                raise ChatError(
                    f"the chat template ({self.where}) does not render messages[:{i}] plus the generation "
                    "prompt as a prefix of the whole conversation, so the assistant turn cannot be located"
                )
            spans.append((len(start), self._turn_end(full, start, self.render(messages[: i + 1]))))
        ids, offsets = self.tokenizer.encode_chat(full)
        targets, k = [], 0
        for begin, _end in offsets:
            while k < len(spans) and begin >= spans[k][1]:
                k += 1
            targets.append(k < len(spans) and spans[k][0] <= begin < spans[k][1])
        return ids, targets


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"'messages' must be a non-empty list of {{role, content}} objects, got {_short(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ChatError(f"messages[{i}] must be an object with a string 'content', got {_short(m)}")
        if m.get("role") not in ROLES:
            raise ChatError(f"messages[{i}] has unknown role {m.get('role')!r} (expected one of {', '.join(ROLES)})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_chat_template(tokenizer, default_tokenizer_path: str) -> ChatTemplate:
    """The run's chat template: the tokenizer folder's, else the built-in one for the shipped
    tokenizer; a ConfigError for a tokenizer that cannot tokenize chat or has no template."""
    path = getattr(tokenizer, "path", None)
    if path is None or not hasattr(tokenizer, "encode_chat"):
        raise ConfigError(
            f"chat data needs a Hugging Face tokenizer.json (model.tokenizer_path), not {type(tokenizer).__name__}; "
            "point model.tokenizer_path at the model's tokenizer folder or use '' for the shipped tokenizer"
        )
    template, where = _read_template(os.path.dirname(path))
    if template is not None:
        return ChatTemplate(template, where, tokenizer)
    if os.path.abspath(path) == os.path.abspath(default_tokenizer_path):
        return ChatTemplate(BUILTIN_TEMPLATE, "the built-in template", tokenizer)
    raise ConfigError(
        f"the tokenizer folder {os.path.dirname(path)} has no chat template (tokenizer_config.json 'chat_template' "
        "or chat_template.jinja); add the model's template there"
    )
