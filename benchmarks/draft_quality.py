"""How good are the drafts themselves? Mean accepted length a perfect verifier gets from each drafter.

    python -m benchmarks.draft_quality --index indexes/python-stdlib --prompts 10 --max-new-tokens 128

The model's plain greedy outputs for the first N HumanEval prompts are computed once (and cached);
then, for every drafter, the decoding loop is replayed without the model (``benchmarks.harness.replay``):
at each step the drafter is asked for a tree, the longest tree path that the greedy output
continues with is accepted, plus one token. For our engine this equals what
``benchmarks.e2e``'s ``paper`` mode measures with the real verifier (the verifier loses nothing); it lets
drafters be compared on identical contexts. Compared:

- ours at several ``n_max`` (REST semantics: the longest matching suffix up to n_max);
- REST's own engine ``draftretriever`` (if installed), built over the same token stream and
  queried as REST does (suffix lengths 16..2, k=5000, choices=budget, long=10).

Prints one JSON object and saves it under benchmarks/results/.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from benchmarks.harness.draftretriever import DraftRetriever
from benchmarks.harness.replay import Example, greedy_outputs, replay
from benchmarks.harness.report import RESULTS, benchmark_parser, report_header, save_report
from benchmarks.harness.sets import humaneval_inputs
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore
from rest_spec.drafter.hf.model import load_model


def quality(examples: list[Example], drafter, config: DraftConfig) -> dict:
    """The replay's figures under this benchmark's names: mean accepted length, mean tree nodes,
    median draft ms."""
    result = replay(examples, drafter, config)
    return {
        "mean_accepted": result["mean_accepted"],
        "mean_tree_nodes": result["verified_per_step"] - 1,
        "median_draft_ms": result["median_draft_ms"],
    }


def main(argv=None) -> int:
    p = benchmark_parser(__doc__, prompts=10, prompts_help="HumanEval prompts")
    p.add_argument("--index", required=True)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="render prompts with the chat template")
    p.add_argument("--n-max", type=int, nargs="+", default=[1, 2, 3, 4, 6, 16])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out_path = args.out or RESULTS / f"draft_quality{'_chat' if args.chat else ''}.json"

    model, tokenizer = load_model(None), load_tokenizer(None)
    examples = greedy_outputs(
        model,
        "humaneval-chat" if args.chat else "humaneval",
        humaneval_inputs(tokenizer, args.prompts, chat=args.chat),
        args.max_new_tokens,
    )

    results = {}
    with Datastore.open(args.index) as store, tempfile.TemporaryDirectory() as tmp:
        for n_max in args.n_max:
            config = DraftConfig(budget=args.budget, n_max=n_max, n_min=min(2, n_max))
            results[f"ours_n_max_{n_max}"] = quality(examples, store, config)
            print(f"ours n_max={n_max}: {results[f'ours_n_max_{n_max}']}", file=sys.stderr)
        try:
            reference = DraftRetriever(store, Path(tmp))
        except ImportError:
            print("draftretriever is not installed: REST's engine not compared", file=sys.stderr)
        else:
            results["draftretriever"] = quality(examples, reference, DraftConfig(budget=args.budget))
            print(f"draftretriever: {results['draftretriever']}", file=sys.stderr)
    report = {
        **report_header("draft_quality", argv),
        "config": {
            "index": args.index,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "budget": args.budget,
            "chat_template": args.chat,
        },
        "results": results,
    }
    save_report(report, out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
