"""The one reader of the prompts files (JSON lines) ``rest-generate`` and ``rest-fill-outputs``
take, and their help. A prompt as token ids (``Prompt``, ``encode_prompt``, ``chat_ids``,
``as_chat``) is ``common.prompts``', which the engines use too; its names answer here as well, for
the commands."""

from __future__ import annotations

import json
from pathlib import Path

from rest_spec.common.errors import CliError
from rest_spec.common.prompts import Prompt, as_chat, chat_ids, encode_prompt

__all__ = ["CHAT_HELP", "PROMPTS_FILE_HELP", "Prompt", "as_chat", "chat_ids", "encode_prompt", "read_prompts"]

PROMPTS_FILE_HELP = (
    'one prompt per line: {"prompt": "raw text"} or {"messages": [{"role": ..., "content": ...}]} '
    "(rendered with the tokenizer's chat template and a generation prompt)"
)
CHAT_HELP = "render raw-text prompts as one user message with the tokenizer's chat template"


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
