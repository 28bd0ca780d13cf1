"""Prompts as token ids: the one place a chat is rendered, so ``rest-generate``, ``rest-chat`` and
the benchmarks feed the model the same tokens for the same conversation; and the one reader of the
prompts files (JSON lines) ``rest-generate`` and ``rest-fill-outputs`` take."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rest_spec.common.errors import CliError

PROMPTS_FILE_HELP = (
    'one prompt per line: {"prompt": "raw text"} or {"messages": [{"role": ..., "content": ...}]} '
    "(rendered with the tokenizer's chat template and a generation prompt)"
)
CHAT_HELP = "render raw-text prompts as one user message with the tokenizer's chat template"


@dataclass(frozen=True)
class Prompt:
    """One prompt: raw ``text`` or chat ``messages`` (rendered with the tokenizer's template)."""

    text: str | None = None
    messages: tuple[dict, ...] | None = None


def chat_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template and a generation
    prompt. The template writes its own special tokens, so the tokenizer adds none."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def as_chat(prompt: Prompt) -> Prompt:
    """A raw-text prompt as one user message (chat prompts unchanged)."""
    if prompt.messages is not None:
        return prompt
    return Prompt(messages=({"role": "user", "content": prompt.text},))


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: raw text as the tokenizer encodes it, chat messages by ``chat_ids``."""
    if prompt.messages is None:
        return tokenizer(prompt.text).input_ids
    return chat_ids(tokenizer, prompt.messages)


def read_prompts(path: Path) -> list[Prompt]:
    """Parse a prompts JSONL file (blank lines skipped); a bad line raises ``CliError`` naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CliError(f"cannot read prompts file {path}: {exc.strerror or exc}") from exc
    prompts = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            prompts.append(_parse_prompt_line(line, f"{path}:{number}"))
    if not prompts:
        raise CliError(f"{path}: no prompts")
    return prompts


def _parse_prompt_line(line: str, where: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CliError(f"{where}: invalid JSON ({exc.msg})") from exc
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return Prompt(text=record["prompt"])
    messages = record.get("messages") if isinstance(record, dict) else None
    if isinstance(messages, list) and messages and all(map(_is_message, messages)):
        return Prompt(messages=tuple(messages))
    raise CliError(f'{where}: expected {{"prompt": "text"}} or {{"messages": [{{"role": ..., "content": ...}}, ...]}}')


def _is_message(message: object) -> bool:
    return (
        isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
    )
