"""User-facing error text shared by the command-line tools."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """An exception's message cut to one line (its type name if empty), for one-line CLI errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
