"""Replaying a drafter against the model's greedy outputs, without the model.

At each step the drafter drafts from the context so far, and the longest tree path the greedy
output follows is accepted, plus one token -- exactly what the lossless verifier accepts, so the
accepted lengths equal a real decoding loop's (a test checks it). Drafters are compared on
identical contexts in seconds instead of a model run each (``benchmarks.draft_quality``,
``benchmarks.tradeoff``, ``benchmarks.merge_rules``; ``set_examples``: a set's prompts with their
greedy outputs). ``benchmarks.e2e`` and ``benchmarks.sharded`` fill the cache of greedy outputs
(``greedy_path``) as they decode.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from benchmarks.harness.sets import INDEXES, ensure_index, set_prompts
from rest_spec.common.cache import cache_dir
from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.hf.generate import generate
from rest_spec.drafter.hf.measure import cost_key

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]  # prompt, the model's greedy output


class Drafts(Protocol):
    """All a replay asks of a drafter (a ``Drafter``, a ``Datastore``, an adapter)."""

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree: ...


def greedy_path(model, name: str, prompts: list[list[int]], max_new_tokens: int) -> Path:
    """Where the greedy outputs of this model on exactly these prompts are cached
    (``$REST_CACHE_DIR/greedy``)."""
    key = cost_key(model)
    digest = hashlib.sha256(json.dumps([key.model, key.parameters, max_new_tokens, prompts]).encode()).hexdigest()[:16]
    return cache_dir() / "greedy" / f"{name}-{len(prompts)}-{digest}.json"


def save_greedy_outputs(path: Path, examples: list[Example]) -> None:
    """Cache ``examples`` at ``path`` (from ``greedy_path``), written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(examples))
    partial.replace(path)


def greedy_outputs(model, name: str, prompts: list[list[int]], max_new_tokens: int) -> list[Example]:
    """Each prompt with the model's plain greedy output, from the cache when this model already
    decoded exactly these prompts (here, or as ``benchmarks.e2e``'s plain mode)."""
    path = greedy_path(model, name, prompts, max_new_tokens)
    if path.exists():
        return [(prompt, output) for prompt, output in json.loads(path.read_text())]
    examples = []
    for i, ids in enumerate(prompts):
        examples.append((ids, generate(model, ids, None, max_new_tokens=max_new_tokens).output_ids))
        log.info("%s: greedy output %d/%d", name, i + 1, len(prompts))
    save_greedy_outputs(path, examples)
    return examples


def replay(
    examples: list[Example],
    drafter: Drafts,
    config: DraftConfig,
    cost: VerifyCost | None = None,
    remember: Callable[[list[int]], object] | None = None,
) -> dict:
    """Mean accepted length, verified tokens per step (tree nodes + 1) and median draft time of
    ``drafter`` on the greedy ``examples``; with a ``cost``, also the speed against plain
    decoding modeled from it (t(1) per token over t(1 + nodes) per step). ``remember`` gets each
    output after its prompt (an output store)."""
    tokens = steps = verified = 0
    seconds = 0.0
    draft_seconds = []
    for prompt, output in examples:
        k = 0
        while k < len(output):
            start = time.perf_counter()
            tree = drafter.draft(prompt + output[:k], config)
            draft_seconds.append(time.perf_counter() - start)
            # the last token is always the model's own: a path never runs past the output
            k += min(len(tree.accepted_nodes(output[k:])), len(output) - k - 1) + 1
            steps += 1
            verified += 1 + len(tree)
            if cost is not None:
                seconds += float(cost(1 + len(tree)))
        tokens += len(output)
        if remember is not None:
            remember(output)
    result = {
        "mean_accepted": tokens / steps,
        "verified_per_step": verified / steps,
        "median_draft_ms": 1e3 * statistics.median(draft_seconds),
    }
    if cost is not None:
        result["modeled_speed_vs_plain"] = tokens * float(cost(1)) / seconds
    return result


def set_examples(name: str, model, tokenizer, args: argparse.Namespace) -> tuple[Path, list[Example]]:
    """The index of set ``name`` (built when missing) and its prompts with the model's greedy
    outputs, as ``args`` (prompts, max_new_tokens, max_prompt_tokens) ask."""
    index = ensure_index(*INDEXES[name])
    prompts = set_prompts(name, tokenizer, index, args.prompts, args.max_prompt_tokens)
    return index, greedy_outputs(model, name, prompts, args.max_new_tokens)
