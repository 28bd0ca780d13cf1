"""``rest-chat``: an interactive chat with REST drafting, replies streamed as tokens are accepted.

Reads one user turn per line from stdin, renders the whole conversation with the tokenizer's chat
template, streams the assistant's reply to stdout and ends each turn with a status line on stderr
(new tokens, tokens/s, verifier steps, mean accepted length, context length). ``/reset`` forgets the
conversation, ``/exit`` (or end of input) quits; Ctrl-C during a reply drops that turn, at the
prompt it quits. The conversation itself is ``drafter.hf.session.ChatSession``. Replies decode as the
model's generation config says (greedy for the packaged SmolLM2) unless the sampling flags say
otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rest_spec.drafter.cli.generation import (
    EXIT_STATUSES,
    add_model_arguments,
    add_sampling_arguments,
    load_parts,
    parse_args,
    run_cli,
    sampling_config,
)
from rest_spec.drafter.hf.session import ChatSession, Reply

COMMANDS = {"/reset": "forget the conversation", "/exit": "quit (so does end of input)"}


def status_line(turn: int, reply: Reply) -> str:
    """The end-of-turn statistics printed on stderr."""
    result = reply.result
    return (
        f"[turn {turn}] {len(result.output_ids)} tokens in {result.seconds:.2f} s "
        f"({result.tokens_per_second:.1f} tok/s), {result.steps} steps, mean accepted "
        f"{result.mean_accepted:.2f}, context {reply.context_tokens} tokens"
    )


def chat(session: ChatSession) -> None:
    """The read-reply loop over stdin until ``/exit``, end of input or Ctrl-C at the prompt: replies
    stream to stdout, everything else goes to stderr."""
    from transformers import TextStreamer

    stderr = sys.stderr
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"[ready; commands: {', '.join(COMMANDS)}]", file=stderr, flush=True)
    prompt = "> " if interactive else ""
    turn = 0
    while True:
        try:
            line = input(prompt).strip()
        except (EOFError, KeyboardInterrupt):
            print(file=stderr)
            return
        if not line:
            continue
        if line.startswith("/"):  # a command, never sent to the model
            command = line.split()[0]
            if command == "/exit":
                return
            if command == "/reset":
                session.reset()
                print("[conversation cleared]", file=stderr, flush=True)
            else:
                print(f"[unknown command {command}; commands: {', '.join(COMMANDS)}]", file=stderr, flush=True)
            continue
        streamer = TextStreamer(session.tokenizer, skip_special_tokens=True)  # our loop never puts the prompt
        try:
            reply = session.reply(line, streamer)
        except KeyboardInterrupt:
            print(flush=True)
            print("[interrupted: this turn is dropped from the conversation]", file=stderr, flush=True)
            continue
        turn += 1
        print(status_line(turn, reply), file=stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rest-chat",
        description="Interactive chat with retrieval-based speculative decoding (REST). Type one user turn "
        "per line; the reply is streamed as tokens are accepted, followed by a status line on stderr "
        "(tokens/s, mean accepted length). The conversation is kept across turns. "
        + "; ".join(f"{name}: {what}" for name, what in COMMANDS.items())
        + "; Ctrl-C during a reply drops that turn.",
        epilog=EXIT_STATUSES,
    )
    add_model_arguments(parser)
    add_sampling_arguments(parser, from_model=True, drafted=True)
    parser.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    return parser


def run(args: argparse.Namespace) -> None:
    """Everything after argument parsing; raises on errors."""
    tokenizer, model, drafter = load_parts(args)
    try:
        # the session decodes with the model's generation config: this process's model, set from the flags
        model.generation_config = sampling_config(model, args)
        if args.seed is not None:  # the session draws from torch's global generator
            import torch

            torch.manual_seed(args.seed)
        session = ChatSession(
            model,
            tokenizer,
            drafter,
            config=args.config,
            max_new_tokens=args.max_new_tokens,
            system=args.system,
            overlap=args.overlap,
        )
        chat(session)
    finally:
        if drafter is not None:
            drafter.close()


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("rest-chat", parse_args(build_parser(), argv), run)


if __name__ == "__main__":
    sys.exit(main())
