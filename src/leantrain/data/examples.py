"""Instruction and chat examples: records read, checked, rendered and tokenized with a loss mask.

Records come from a ``.jsonl``, ``.json`` or ``.parquet`` file or a Hugging Face ``datasets``
directory (:mod:`leantrain.data.records`). Formats (``data.format``, or detected from the first
record's fields):

- ``instruct``: ``{"prompt": str, "completion": str}`` (``"response"`` is read as the
  completion). Tokens: ``[bos] + encode(prompt) + encode(completion) + [eos]`` (bos / eos when the
  tokenizer has them; prompt and completion encoded apart, as a prompt is encoded when the model
  is asked to complete it). Trained on: the completion and the eos.
- ``chat``: ``{"messages": [{"role": str, "content": str}, ...]}``, rendered with the tokenizer's
  chat template (jinja2, with Hugging Face's conventions: ``messages``, ``add_generation_prompt``,
  ``bos_token``, ``eos_token``, ``raise_exception``), else with ``DEFAULT_CHAT_TEMPLATE``
  (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message). Trained on: each assistant message as
  the template renders it (its content and the template's end-of-turn text), found as the text the
  conversation gains from ``messages[:i]`` with the generation prompt to ``messages[:i + 1]``; a
  template for which the first is not a prefix of the second is refused.
- multiple choice (``{"prompt", "choices", "answer"}``): read by ``leantrain eval`` only.

With ``data.mask_prompt`` false every token is trained on. A malformed record is a ``ConfigError``
naming the file, the line (JSONL) or row (counted from 1) and what is missing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from leantrain.config import ConfigError
from leantrain.data.records import is_record_file, read_jsonl, read_records

__all__ = ["FORMATS", "ChatTemplate", "check_record", "detect_format", "encode_example", "example_texts",
           "read_jsonl", "read_records", "record_format", "record_format_of", "records"]

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FORMATS = ("text", "instruct", "chat", "choice")


def record_format(rec: dict) -> str | None:
    """The format a record's fields say: text, instruct, chat or choice (None: none of them)."""
    if "messages" in rec:
        return "chat"
    if "choices" in rec:
        return "choice"
    if "prompt" in rec and ("completion" in rec or "response" in rec):
        return "instruct"
    if "text" in rec:
        return "text"
    return None


def detect_format(path: Path) -> str:
    """The format of a record file (``records.read_records``) from its first record's fields."""
    for i, rec in read_records(path):
        fmt = record_format(rec)
        if fmt is None:
            raise ConfigError(f"{path}:{i}: no known fields ({', '.join(sorted(rec)) or 'none'}); each record "
                              "needs a string field 'text', or 'prompt' and 'completion', or 'messages', or "
                              "'prompt', 'choices' and 'answer'")
        return fmt
    raise ConfigError(f"data file {path} holds no records")


def record_format_of(path: Path) -> str:
    """What ``path`` holds: the format of a record file (``records.is_record_file``), else ``"text"``."""
    return detect_format(path) if is_record_file(path) else "text"


def check_record(rec: dict, fmt: str, where: str) -> None:
    """``ConfigError`` naming ``where`` (file:line) and what is missing when ``rec`` is not a ``fmt`` line."""
    def need_str(obj: dict, key: str, what: str) -> None:
        if not isinstance(obj.get(key), str):
            got = "missing" if key not in obj else "null" if obj[key] is None else f"a {type(obj[key]).__name__}"
            raise ConfigError(f"{where}: {what} needs a string '{key}' ({got})")

    if fmt == "text":
        need_str(rec, "text", "a text line")
    elif fmt == "instruct":
        need_str(rec, "prompt", "an instruct line")
        need_str(rec, "completion" if "completion" in rec or "response" not in rec else "response", "an instruct line")
    elif fmt == "chat":
        msgs = rec.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ConfigError(f"{where}: a chat line needs 'messages', a non-empty list of {{'role', 'content'}}")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ConfigError(f"{where}: message {j} is not an object with 'role' and 'content'")
            need_str(m, "role", f"message {j}")
            need_str(m, "content", f"message {j}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ConfigError(f"{where}: a chat line needs at least one 'assistant' message (nothing to train on)")
    elif fmt == "choice":
        need_str(rec, "prompt", "a multiple-choice line")
        choices = rec.get("choices")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise ConfigError(f"{where}: a multiple-choice line needs 'choices', a list of at least two strings")
        answer = rec.get("answer")
        if not (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices)) and \
                answer not in choices:
            raise ConfigError(f"{where}: 'answer' must be the index of the right choice (0 to {len(choices) - 1}) "
                              "or its text")


def records(path: Path, fmt: str) -> Iterator[tuple[int, dict]]:
    """(row number, checked object) of every record of a ``fmt`` record file (``records.read_records``)."""
    for i, rec in read_records(path):
        check_record(rec, fmt, f"{path}:{i}")
        yield i, rec


class ChatTemplate:
    """A chat template compiled as Hugging Face compiles it (a sandboxed jinja2 environment that
    trims blocks, with ``raise_exception``, ``strftime_now`` and a ``tojson`` filter)."""

    def __init__(self, source: str | None = None, *, bos_token: str | None = None, eos_token: str | None = None):
        from datetime import datetime

        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: \
            json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.default = source is None
        self.template = env.from_string(DEFAULT_CHAT_TEMPLATE if source is None else source)
        self.specials = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
        self._error = TemplateError

    @classmethod
    def of(cls, tok) -> ChatTemplate:
        """The template of a tokenizer (its ``chat_template``, else the default) with its bos / eos tokens."""
        inner, bos = tok.tokenizer, getattr(tok, "bos_id", None)
        return cls(getattr(tok, "chat_template", None),
                   bos_token=inner.id_to_token(bos) if bos is not None else None,
                   eos_token=inner.id_to_token(tok.eot_id) if tok.eot_id is not None else None)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "") -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.specials)
        except self._error as e:
            raise ConfigError(f"{where}: the chat template refused this conversation ({e})") from None


def _chat_ids(rec: dict, tok, template: ChatTemplate, where: str) -> tuple[list[int], list[bool]]:
    msgs = rec["messages"]
    text = template.render(msgs, where=where)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = template.render(msgs[:i], add_generation_prompt=True, where=where)
        upto = template.render(msgs[:i + 1], where=where)
        if not upto.startswith(before) or not text.startswith(upto):
            raise ConfigError(f"{where}: the chat template does not render the conversation as a sequence of "
                              "turns (a shorter conversation is not a prefix of a longer one), so the assistant "
                              "tokens cannot be found; give instruct lines instead")
        spans.append((len(before), len(upto)))
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    train = [any(a <= start < b for a, b in spans) for start, _ in enc.offsets]
    return list(enc.ids), train


def encode_example(rec: dict, fmt: str, tok, template: ChatTemplate | None, where: str
                   ) -> tuple[list[int], list[bool]]:
    """(token ids, whether each token is trained on) of one instruct or chat example."""
    if fmt == "chat":
        return _chat_ids(rec, tok, template, where)
    bos, eos = getattr(tok, "bos_id", None), tok.eot_id
    prompt = ([bos] if bos is not None else []) + tok.encode(rec["prompt"])
    completion = tok.encode(rec["completion"] if "completion" in rec else rec["response"])
    completion += [eos] if eos is not None else []
    return prompt + completion, [False] * len(prompt) + [True] * len(completion)


def example_texts(path: Path, fmt: str) -> Iterator[str]:
    """The text of each example (for training a tokenizer): the rendered conversation, or prompt + completion."""
    template = ChatTemplate()
    for i, rec in records(path, fmt):
        if fmt == "chat":
            yield template.render(rec["messages"], where=f"{path}:{i}")
        else:
            yield rec["prompt"] + (rec["completion"] if "completion" in rec else rec["response"])
