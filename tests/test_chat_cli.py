"""The chat command lines on the real SmolLM2 and the real stdlib index, each command's ``main`` in
process: ``rest-chat`` streams each reply exactly as plain greedy ``model.generate`` produces it for
the same conversation, keeps the history across turns, reports each turn; ``rest-generate --chat``
renders prompts as a user turn; Ctrl-C mid-reply and end of input are handled (``ChatSession`` and
``chat``)."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from transformers.generation import BaseStreamer

from rest_spec.common.types import DraftConfig
from rest_spec.drafter.cli import chat as chat_cli
from rest_spec.drafter.cli import rest_generate
from rest_spec.drafter.cli.chat import chat
from rest_spec.drafter.cli.prompts import chat_ids
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.hf.session import ChatSession

pytestmark = pytest.mark.model
NEW_TOKENS = 24
TURNS = ["Write a Python function that adds two numbers.", "Now make it multiply them instead."]
STATUS = re.compile(
    r"\[turn (\d+)\] (\d+) tokens in [\d.]+ s \([\d.]+ tok/s\), (\d+) steps, mean accepted ([\d.]+), "
    r"context (\d+) tokens"
)


def greedy_reply(model, tokenizer, messages: list[dict]) -> tuple[str, int, int, list[int]]:
    """(reply text, new tokens, prompt tokens, reply ids) of plain greedy ``model.generate``."""
    ids = torch.tensor([chat_ids(tokenizer, messages)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
    new = out[0, ids.shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), len(new), ids.shape[1], new.tolist()


@pytest.fixture(scope="module")
def conversation(smollm2):
    """The greedy replies to ``TURNS`` with the history kept: [(text, new tokens, prompt tokens, ids)]."""
    model, tokenizer = smollm2
    messages, replies = [], []
    for user in TURNS:
        messages.append({"role": "user", "content": user})
        replies.append(greedy_reply(model, tokenizer, messages))
        messages.append({"role": "assistant", "content": replies[-1][0]})
    return replies


def test_chat_streams_replies_keeps_history_and_reports(stdlib_index, conversation, command):
    """Two turns, /reset, the first turn again, /exit (later lines ignored)."""
    stdin = "\n".join([TURNS[0], TURNS[1], "/reset", TURNS[0], "/exit", TURNS[1]]) + "\n"
    status, out, err = command(
        chat_cli.main, ["--datastore", str(stdlib_index), "--max-new-tokens", str(NEW_TOKENS)], stdin
    )
    assert status == 0, err
    first, second = conversation
    assert out == f"{first[0]}\n{second[0]}\n{first[0]}\n"
    statuses = [STATUS.search(line) for line in err.splitlines()]
    statuses = [m.groups() for m in statuses if m]
    assert [(int(t), int(n), int(c)) for t, n, _, _, c in statuses] == [
        (1, first[1], first[2]),
        (2, second[1], second[2]),
        (3, first[1], first[2]),
    ]
    assert second[2] > first[2] + first[1]  # the second prompt holds the whole first exchange
    assert "[conversation cleared]" in err
    for _, tokens, steps, accepted, _ in statuses:
        assert float(accepted) == pytest.approx(int(tokens) / int(steps), abs=0.005)


def test_rest_generate_chat_flag(stdlib_index, conversation, command):
    """``rest-generate --chat``: the prompt as the first user turn, the reply plain greedy decoding's."""
    argv = ["--datastore", str(stdlib_index), "--prompt", TURNS[0], "--chat", "--max-new-tokens", str(NEW_TOKENS)]
    status, out, err = command(rest_generate.main, [*argv, "--json"])
    assert status == 0, err
    assert json.loads(out)["output_ids"] == conversation[0][3]


@pytest.fixture(scope="module")
def session(smollm2, stdlib_index):
    model, tokenizer = smollm2
    with LocalDrafter.open(stdlib_index) as drafter:
        yield ChatSession(
            model, tokenizer, drafter, config=DraftConfig(), max_new_tokens=8, system="Answer in one line."
        )


class InterruptAfterFirstStep(BaseStreamer):
    """A streamer whose first ``put`` raises KeyboardInterrupt, as Ctrl-C does mid-reply."""

    def put(self, value) -> None:
        raise KeyboardInterrupt

    def end(self) -> None:
        pass


def test_interrupted_reply_leaves_the_history_unchanged(smollm2, session):
    _, tokenizer = smollm2
    session.reset()
    system = [{"role": "system", "content": "Answer in one line."}]
    expected = chat_ids(tokenizer, [*system, {"role": "user", "content": TURNS[0]}])
    assert session.prompt_ids(TURNS[0]) == expected
    with pytest.raises(KeyboardInterrupt):
        session.reply(TURNS[0], InterruptAfterFirstStep())
    assert session.messages == system


def test_end_of_input_ends_the_chat(session, monkeypatch, capsys):
    session.reset()
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{TURNS[0]}\n\n/unknown\n"))
    chat(session)  # returns at end of input
    out, err = capsys.readouterr()
    assert out == session.messages[-1]["content"] + "\n" and out.strip()
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    assert "[turn 1] 8 tokens" in err and "unknown command /unknown" in err
