"""Prompts as token ids: the one place a chat is rendered, so the decoding loops, the command-line
tools and the benchmarks feed the model the same tokens for the same conversation. Reading them
from a prompts file is the command line's (``drafter.cli.prompts``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
