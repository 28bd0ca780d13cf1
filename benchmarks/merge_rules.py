"""Which merge of the draft sources accepts most: ours against the three published rules and REST, replayed offline.

    python -m benchmarks.merge_rules --prompts 40 --max-new-tokens 128

The prompt sets, indexes and cached greedy outputs of ``benchmarks.tradeoff``; every drafter gets
the same ``--budget`` nodes a step (no cost-based size) and is replayed against the greedy outputs
(``benchmarks.harness.replay``: accepted lengths equal a real run's). Every merge sees the same sources,
drafted as ``AdaptiveDrafter`` drafts them -- the index's longest match, the request's own text,
the store of past outputs (each drafter its own store, fed with each output after its prompt):

- ``ours``: ``AdaptiveDrafter`` as is (calibrated per-source path probabilities, noisy-OR);
- ``ours+suffixes``: ours with the index asked again for the context cut to its last 4, 2 and 1
  tokens (``AdaptiveDrafter(suffixes=SUFFIX_CUTS)``; only the cuts whose match is shorter than the
  longest), each an extra source with its own calibration;
- ``arctic`` (ArcticInference's suffix decoding): each source's own tree, the one whose expected
  accepted tokens (sum of its node probabilities) is highest;
- ``sglang``: a node scores its best source's prior x (specificity + confidence): specificity the
  source's match length over ``n_max``, confidence the node's path probability under the source;
- ``llama.cpp`` (ngram cache): tiered fallback -- the request's tree if it has any node, else the
  outputs', else the index's -- each node scored by its frequency there x its static frequency
  (the index's path probability for the last two context tokens; x100 where present, 1 where not,
  as ``common_ngram_cache_draft`` weighs them);
- ``ours sized`` and ``ours+suffixes sized``: the same two, each step's tree cut to what pays
  on this hardware (``drafter.core.selection.select_tree`` with the measured cost, as the tradeoff
  benchmark's ``adaptive`` row);
- ``paper``: the index alone (REST's semantics in our engine);
- ``rest``: REST's own engine (``benchmarks.harness.draftretriever.DraftRetriever``, ``--budget`` paths).

Prints a table (mean accepted length, its ratio to ``rest``, verified tokens per step, the speed
modeled from the measured cost as in ``benchmarks.tradeoff``, median draft ms) and saves JSON under
benchmarks/results/merge_rules.json.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness.draftretriever import DraftRetriever
from benchmarks.harness.replay import Drafts, Example, replay, set_examples
from benchmarks.harness.report import RESULTS, benchmark_parser, save_report, start_run
from benchmarks.harness.sets import DEFAULT_SETS, SETS
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig, DraftTree, SourceTrees
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.merge import merge_trees
from rest_spec.drafter.core.steps import SUFFIX_CUTS
from rest_spec.drafter.hf.measure import load_or_measure
from rest_spec.drafter.hf.model import load_model

STATIC_SUFFIX = 2  # llama.cpp's static n-gram size (LLAMA_NGRAM_STATIC)
SGLANG_PRIORS = {"index": 1.0, "request": 1.0, "outputs": 1.0}


@dataclasses.dataclass(frozen=True)
class StaticTrees(SourceTrees):
    """``SourceTrees`` with llama.cpp's static tree: the index's for the last ``STATIC_SUFFIX`` tokens."""

    static: DraftTree = dataclasses.field(default_factory=DraftTree.empty)


class StaticDrafter(LocalDrafter):
    """A ``LocalDrafter`` whose ``draft_sources`` also answers the static tree."""

    def draft_sources(self, context: Sequence[int], config: DraftConfig) -> StaticTrees:
        trees = super().draft_sources(context, config)
        static = self.datastore.draft(context[-STATIC_SUFFIX:], dataclasses.replace(config, n_min=1))
        return StaticTrees(trees.index, trees.outputs, static)


def path_probs(union: DraftTree) -> np.ndarray:
    """float64 [n, S]: each source's path probability of every node of a merged tree (the product
    of its conditional probabilities from the root; 0 below a node it did not propose)."""
    probs = np.array(union.source_probs)
    for depth in range(2, union.max_depth + 1):  # parents come a level earlier
        level = np.flatnonzero(union.depths == depth)
        probs[level] *= probs[union.parents[level]]
    return probs


def top_by(union: DraftTree, scores: np.ndarray, budget: int) -> DraftTree:
    """The ``budget`` best nodes of ``union`` by ``scores`` (>= 0), each first capped by its
    ancestors' so the kept set is prefix-closed (ties go to the earlier BFS node); scores above 1
    are scaled down to end at 1 (a ``DraftTree``'s), others kept."""
    capped = np.array(scores, dtype=np.float64)
    for depth in range(2, union.max_depth + 1):
        level = np.flatnonzero(union.depths == depth)
        capped[level] = np.minimum(capped[level], capped[union.parents[level]])
    keep = np.sort(np.argsort(-capped, kind="stable")[:budget])
    return dataclasses.replace(union.subset(keep), scores=capped[keep] / max(1.0, capped.max(initial=0.0)))


def union_of(trees: Sequence[DraftTree]) -> DraftTree:
    """Every node of ``trees``, with each source's conditional probabilities (``merge_trees``, no budget)."""
    return merge_trees(trees, np.ones(len(trees)), sum(map(len, trees)))


def arctic(trees: dict[str, DraftTree], config: DraftConfig) -> DraftTree:
    """ArcticInference: the source tree (its ``budget`` best nodes) with the highest expected
    accepted tokens, the sum of its nodes' probabilities."""
    best = [top_by(tree, tree.scores, config.budget) for tree in trees.values() if len(tree)]
    return max(best, key=lambda tree: float(tree.scores.sum()), default=DraftTree.empty())


def sglang(trees: dict[str, DraftTree], config: DraftConfig) -> DraftTree:
    """SGLang: a node scores max over sources of prior x (specificity + confidence)."""
    union = union_of(list(trees.values()))
    proposed = np.asarray(union.source_probs) > 0
    specificity = np.array([min(tree.match_len, config.n_max) / config.n_max for tree in trees.values()])
    priors = np.array([SGLANG_PRIORS[name] for name in trees])
    scores = np.where(proposed, priors * (specificity + path_probs(union)), 0.0).max(axis=1, initial=0.0)
    return top_by(union, scores, config.budget)


def llama_cpp(trees: dict[str, DraftTree], config: DraftConfig, static: DraftTree) -> DraftTree:
    """llama.cpp: the first non-empty tier of request, outputs, index; each node's frequency there
    x 100 x its static frequency where the static tree has the node, x 1 where not."""
    tier = next((trees[name] for name in ("request", "outputs", "index") if len(trees[name])), DraftTree.empty())
    if not len(tier):
        return tier
    union = union_of([tier, static])
    probs = path_probs(union)
    scores = probs[:, 0] * np.where(probs[:, 1] > 0, 100 * probs[:, 1], 1.0)
    return top_by(union.subset(np.flatnonzero(probs[:, 0] > 0)), scores[probs[:, 0] > 0], config.budget)


class RuleDrafter(AdaptiveDrafter):
    """``AdaptiveDrafter``'s sources, merged by ``rule`` instead of ``merge_trees``."""

    def __init__(self, base: StaticDrafter, rule: str, config: DraftConfig) -> None:
        super().__init__(base, cost=None, config=config)
        self.rule = rule

    def record(self, trees: Sequence[DraftTree], merged: Sequence[DraftTree]) -> None:
        """Nothing: the published rules learn nothing from what the verifier accepts."""

    def merge(self, shared: StaticTrees, request: DraftTree, config: DraftConfig) -> DraftTree:
        trees = {"index": shared.index, "request": request, "outputs": shared.outputs}
        if self.rule == "arctic":
            return arctic(trees, config)
        if self.rule == "sglang":
            return sglang(trees, config)
        return llama_cpp(trees, config, shared.static)


def drafters(config: DraftConfig, cost: VerifyCost) -> dict[str, Callable[[StaticDrafter], Drafts]]:
    """Label -> the drafter built over a freshly opened ``StaticDrafter`` (its own output store)."""
    return {
        "ours": lambda base: AdaptiveDrafter(base, cost=None, config=config),
        "ours+suffixes": lambda base: AdaptiveDrafter(base, cost=None, config=config, suffixes=SUFFIX_CUTS),
        "ours sized": lambda base: AdaptiveDrafter(base, cost=cost, config=config),
        "ours+suffixes sized": lambda base: AdaptiveDrafter(base, cost=cost, config=config, suffixes=SUFFIX_CUTS),
        "arctic": lambda base: RuleDrafter(base, "arctic", config),
        "sglang": lambda base: RuleDrafter(base, "sglang", config),
        "llama.cpp": lambda base: RuleDrafter(base, "llama.cpp", config),
        "paper": lambda base: base,
    }


def run_set(
    examples: list[Example], index: Path, config: DraftConfig, cost: VerifyCost, only: Sequence[str] | None = None
) -> dict:
    """Each drafter's replay figures on ``examples``, speed modeled by ``cost`` (``only``: those
    labels, ``rest`` among them)."""
    results = {}
    for label, build in drafters(config, cost).items():
        if only is not None and label not in only:
            continue
        with StaticDrafter.open(index) as base:
            drafter = build(base)
            remember = drafter.add_output if isinstance(drafter, AdaptiveDrafter) else None
            results[label] = replay(examples, drafter, config, cost, remember)
        logging.info("%s: %s", label, results[label])
    if only is None or "rest" in only:
        with StaticDrafter.open(index) as base, tempfile.TemporaryDirectory() as tmp:
            results["rest"] = replay(examples, DraftRetriever(base.datastore, Path(tmp)), config, cost)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = benchmark_parser(__doc__, sets=SETS, default_sets=DEFAULT_SETS)
    p.add_argument("--budget", type=int, default=64, help="nodes per step for every drafter (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="as in benchmarks.e2e (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS / "merge_rules.json")
    args = p.parse_args(argv)
    sets = args.sets
    header = start_run("merge_rules", argv)
    model, tokenizer = load_model(None), load_tokenizer(None)
    config, cost = DraftConfig(budget=args.budget), load_or_measure(model)
    report = {
        **header,
        "config": {"prompts_per_set": args.prompts, "max_new_tokens": args.max_new_tokens, "budget": args.budget},
        "sets": {},
    }
    for name in sets:
        index, examples = set_examples(name, model, tokenizer, args)
        results = run_set(examples, index, config, cost)
        report["sets"][name] = results
        print(f"{name}: {'drafter':<20} {'accepted':>9} {'x rest':>7} {'verified':>9} {'speed':>6} {'draft ms':>9}")
        for label, row in results.items():
            print(
                f"{name}: {label:<20} {row['mean_accepted']:9.3f} "
                f"{row['mean_accepted'] / results['rest']['mean_accepted']:7.3f} "
                f"{row['verified_per_step']:9.2f} {row['modeled_speed_vs_plain']:6.3f} {row['median_draft_ms']:9.2f}"
            )
    save_report(report, args.out, echo=False)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
