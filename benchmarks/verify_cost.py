"""What verifying n tokens costs, before and after this project's verifier changes, and where the time goes.

    python -m benchmarks.verify_cost --rounds 3

For each n, one ``verify_trees`` step of a tree of n - 1 nodes on a 512-token cache
(``rest_spec.drafter.hf.measure.verify_timer``), rounds interleaved, medians over rounds:

- "before": PyTorch's layout of the linear layers on the ``DynamicCache`` that ``model.generate``
  builds (appending by concatenation);
- "pytorch" and "transposed": the project's cache (``kv_cache.new_cache``, appending in place) in
  each layout (``drafter.hf.linear_layout``);
- "after": what the cost model prices once the faster layout and padding to a cheaper larger
  block are allowed (``VerifyCost``).

With ``--compiled``, also "compiled": the project's cache in PyTorch's layout with the model's
forward under ``torch.compile(dynamic=True)`` (one graph for every n and cache length; the JSON
records whether a 16-token block's argmax equals eager's).

Everything is relative to "before" at n = 1: the step ``model.generate`` runs. A per-op profile
(torch.profiler, self CPU time) of a step of each size, before and after (the project's cache,
transposed), says where the time goes. Prints a table and saves JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.report import RESULTS, comma_list, report_header, save_report
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.hf.measure import DEFAULT_CONTEXT_LENGTH, cost_key, measured_tree, verify_timer
from rest_spec.drafter.hf.model import load_model

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64)
PROFILED = (1, 2, 4, 8, 16)


def op_profile(model, n: int, after: bool, top: int = 6) -> dict[str, float]:
    """Milliseconds of self CPU time per op over one step of n tokens, the ``top`` largest;
    before (generate's cache, PyTorch's layout) or after (the project's cache, transposed)."""
    from torch.profiler import ProfilerActivity, profile

    time_step = verify_timer(model, repeats=1, warmup=1, plain_cache=not after)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_step(measured_tree(n), after)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {op.key: round(op.self_cpu_time_total / 2e3, 2) for op in ops}  # two steps ran: warmup + 1


def same_choices(model, other, n: int = 16, context_length: int = 300) -> bool:
    """Whether ``other`` picks the same greedy token as ``model`` at every position of a block of
    n tokens on a random context."""
    import torch

    from rest_spec.drafter.hf.internals import forward_with_cache
    from rest_spec.drafter.hf.kv_cache import CacheRows, new_cache
    from rest_spec.drafter.hf.tree_attention import build_tree_inputs
    from rest_spec.drafter.hf.verify import tree_logits

    context = torch.randint(
        int(model.config.vocab_size), (1, context_length + 1), generator=torch.Generator().manual_seed(1)
    )
    choices = []
    for each in (model, other):
        cache = new_cache(each)
        with torch.inference_mode():
            forward_with_cache(each, cache, input_ids=context[:, :-1].to(each.device))
            block = build_tree_inputs(
                [int(context[0, -1])], [measured_tree(n)], CacheRows.full(1, context_length), each.device, n
            )
            choices.append(tree_logits(each, cache, block).argmax(-1).cpu())
    return bool(torch.equal(*choices))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over every size (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per size per round (default: %(default)s)")
    p.add_argument(
        "--sizes",
        type=comma_list(item=int, empty=True),
        default=",".join(map(str, SIZES)),
        help="n to time, from 1 (default: %(default)s)",
    )
    p.add_argument(
        "--profile",
        type=comma_list(item=int, empty=True),
        default=",".join(map(str, PROFILED)),
        help="n to profile (default: %(default)s)",
    )
    p.add_argument("--compiled", action="store_true", help="also time the forward under torch.compile")
    p.add_argument("--out", type=Path, default=RESULTS / "verify_cost.json")
    args = p.parse_args(argv)
    sizes, profiled = tuple(args.sizes), tuple(args.profile)
    model = load_model(None)
    generate_step = verify_timer(model, repeats=args.repeats, plain_cache=True)
    project_step = verify_timer(model, repeats=args.repeats)
    variants = {
        "before": lambda tree: generate_step(tree, False),
        "pytorch": lambda tree: project_step(tree, False),
        "transposed": lambda tree: project_step(tree, True),
    }
    compiled = None
    if args.compiled:
        import torch

        compiled = load_model(None)
        compiled.forward = torch.compile(compiled.forward, dynamic=True)
        compiled_step = verify_timer(compiled, repeats=args.repeats)
        variants["compiled"] = lambda tree: compiled_step(tree, False)
    runs: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for n in sizes:
            for name, time_step in variants.items():
                runs.setdefault((n, name), []).append(time_step(measured_tree(n)))
    medians = {name: [statistics.median(runs[n, name]) for n in sizes] for name in variants}
    best = [min(a, b) for a, b in zip(medians["pytorch"], medians["transposed"])]
    layouts = tuple(b < a for a, b in zip(medians["pytorch"], medians["transposed"]))
    after = VerifyCost(cost_key(model), DEFAULT_CONTEXT_LENGTH, sizes, tuple(best), (), layouts)
    one = medians["before"][0]
    rows = [
        {
            "n": n,
            **{name: times[i] / one for name, times in medians.items()},
            "after": float(after(n)) / one,
            "block": after.block_shape([measured_tree(n)]).size,
        }
        for i, n in enumerate(sizes)
    ]
    print(f"t(1) before: {1e3 * one:.1f} ms (model.generate's step)")
    columns = [*variants, "after"]
    print(f"{'n':>4} " + " ".join(f"{name[:10]:>10}" for name in columns) + f" {'block':>6}")
    for row in rows:
        print(f"{row['n']:4d} " + " ".join(f"{row[name]:10.2f}" for name in columns) + f" {row['block']:6d}")
    profiles = {
        f"{n} {'after' if late else 'before'}": op_profile(model, n, late) for n in profiled for late in (False, True)
    }
    for label, ops in profiles.items():
        print(f"profile n={label}: " + ", ".join(f"{op} {ms} ms" for op, ms in ops.items()))
    report = {
        **report_header("verify_cost", argv),
        "one_token_ms": 1e3 * one,
        "relative_to_one_plain_token": rows,
        "profiles_ms": profiles,
    }
    if compiled is not None:
        report["compiled_choices_equal_eager"] = same_choices(model, compiled)
        print(f"compiled: a 16-token block's argmax equals eager's: {report['compiled_choices_equal_eager']}")
    save_report(report, args.out, echo=False)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
