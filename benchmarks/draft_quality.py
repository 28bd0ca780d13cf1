"""How good are the drafts themselves? Mean accepted length a perfect verifier gets from each drafter.

    python -m benchmarks.draft_quality --index indexes/python-stdlib --prompts 10 --max-new-tokens 128

The model's plain greedy outputs for the first N HumanEval prompts are computed once; then, for
every drafter, the decoding loop is replayed without the model: at each step the drafter is asked
for a tree, the longest tree path that the greedy output continues with is accepted, plus one
token. For our engine this equals what ``benchmarks.humaneval`` measures with the real verifier
(the verifier loses nothing); it lets drafters be compared on identical contexts. Compared:

- ours at several ``n_max`` (REST semantics: the longest matching suffix up to n_max);
- REST's own engine ``draftretriever`` (if installed), built over the same token stream and
  queried as REST does (suffix lengths 16..2, k=5000, choices=budget, long=10).

Prints one JSON object and saves it under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from benchmarks.data import humaneval_inputs, save_report
from datastore.index import Datastore
from datastore.tokenizer import load_tokenizer
from datastore.types import DraftConfig
from drafter.generate import generate
from drafter.model import load_model

RESULTS = Path(__file__).parent / "results"
PathsFn = Callable[[Sequence[int]], list[tuple[int, ...]]]


def replay(outputs: list[tuple[list[int], list[int]]], paths_fn: PathsFn) -> dict:
    """Mean accepted length (new tokens / steps) and mean tree size of ``paths_fn`` on ``outputs``."""
    tokens = steps = 0
    sizes, seconds = [], []
    for prompt, out in outputs:
        k = 0
        while k < len(out):
            t0 = time.perf_counter()
            paths = paths_fn(prompt + out[:k])
            seconds.append(time.perf_counter() - t0)
            prefixes = {p[:d] for p in paths for d in range(1, len(p) + 1)}
            sizes.append(len(prefixes))
            accepted = 0
            while accepted < len(out) - k - 1 and tuple(out[k : k + accepted + 1]) in prefixes:
                accepted += 1
            k += accepted + 1
            steps += 1
        tokens += len(out)
    return {"mean_accepted": tokens / steps, "mean_tree_nodes": float(np.mean(sizes)),
            "median_draft_ms": 1e3 * statistics.median(seconds)}


def draftretriever_paths(store: Datastore, budget: int, workdir: Path) -> PathsFn | None:
    """REST's engine over the same documents as ``store``, queried the way REST's code does."""
    try:
        import draftretriever
    except ImportError:
        return None
    path = str(workdir / "draftretriever.idx")
    writer = draftretriever.Writer(file_path=path, vocab_size=store.vocab_size)
    for document in store.documents():
        writer.add_entry(document.tolist())
    writer.finalize()
    reader = draftretriever.Reader(index_file_path=path)

    def paths(context: Sequence[int]) -> list[tuple[int, ...]]:
        for n in range(16, 1, -1):
            if len(context) >= n:
                found = reader.search(list(context[-n:]), k=5000, choices=budget, long=10)[0]
                if found:
                    return [tuple(t for t in p if t >= 0) for p in found]  # -2 pads short paths
        return []

    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", required=True)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="render prompts with the chat template")
    p.add_argument("--n-max", type=int, nargs="+", default=[1, 2, 3, 4, 6, 16])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out_path = args.out or RESULTS / f"draft_quality{'_chat' if args.chat else ''}.json"

    model, tokenizer = load_model(None), load_tokenizer(None)
    outputs = [(ids, generate(model, ids, None, max_new_tokens=args.max_new_tokens).output_ids)
               for ids in humaneval_inputs(tokenizer, args.prompts, chat=args.chat)]

    results = {}
    with Datastore.open(args.index) as store, tempfile.TemporaryDirectory() as tmp:
        for n_max in args.n_max:
            config = DraftConfig(budget=args.budget, n_max=n_max, n_min=min(2, n_max))
            results[f"ours_n_max_{n_max}"] = replay(outputs, lambda c, config=config: store.draft(c, config).paths())
            print(f"ours n_max={n_max}: {results[f'ours_n_max_{n_max}']}", file=sys.stderr)
        reference = draftretriever_paths(store, args.budget, Path(tmp))
        if reference is not None:
            results["draftretriever"] = replay(outputs, reference)
            print(f"draftretriever: {results['draftretriever']}", file=sys.stderr)
    report = {
        "benchmark": "draft_quality",
        "command": "python -m benchmarks.draft_quality " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {"index": args.index, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                   "budget": args.budget, "chat_template": args.chat},
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    save_report(report, out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
