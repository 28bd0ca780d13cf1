"""Sharded serving against one server and in-process drafting, over one index: exact answers, draft
latency, throughput and end-to-end generation speed.

    python -m benchmarks.sharded --prompts 40 --contexts 5000

The index: the packaged ShareGPT corpus less its last 400 conversations, split into 4 shards
(indexes/bench/sharegpt-4shards, built when missing). Topologies over that one index:
``inprocess`` (the index opened in this process), ``serve`` (one ``rest-datastore serve``) and
``router/K`` (one ``rest-datastore route`` over K ``serve --shards`` processes, the shards split
evenly and contiguously) for each K of ``--routers``; every server on a free loopback port, all
up for the whole run.

1. Exactness: ``--contexts`` 16-token windows of the held-out conversations (never indexed; the
   retrieval benchmark's queries) in ``DraftBatch`` calls of ``--batch`` through every router,
   compared tree for tree (tokens, parents, counts, match length, matches, sampled) with the index
   in process: the mismatches per router, and how many contexts matched and were sampled (the
   router's second round).
2. Draft latency: single ``Draft`` calls (one client, ``--budget``) of the same contexts, every
   topology in turn for several rounds after a warm-up (the retrieval benchmark's rounds): p50, p99.
3. Throughput: ``--clients`` client processes (``benchmarks.harness.servers.drive``) sending ``Draft`` calls to each
   server for ``--seconds`` after ``--warmup``: requests/s, latency, errors, resident memory of
   every process of the topology.
4. Generation: the first ``--prompts`` held-out ShareGPT prompts (benchmarks.e2e's), greedy,
   ``--max-new-tokens``, an adaptive drafter per topology (overlap on for the servers, off in
   process; calibration carried from prompt to prompt; no outputs stored), interleaved per prompt
   after plain decoding (the reference): per mode the median per-prompt speed vs plain and vs
   ``serve``, the mean accepted length and how drafting overlapped verification.

Prints the summary and the targets (benchmarks/targets.json, "sharded") with pass/fail and saves
the JSON report: to benchmarks/results/sharded.json when run with every default, else to --out
(required then). Exit status 1 when an output differs from plain decoding or a router's tree from
the index's in process; the servers' logs are then kept in a temporary directory the report names.
Timings mean something only on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import shutil
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness.generation import record, summarize
from benchmarks.harness.replay import greedy_path, save_greedy_outputs
from benchmarks.harness.report import RESULTS, benchmark_parser, check, comma_list, load_targets, save_report, start_run
from benchmarks.harness.retrieval_timing import compare_latency, sample_queries
from benchmarks.harness.servers import draft_requests, drive, start_datastore, stop
from benchmarks.harness.sets import INDEXES, ensure_index, set_prompts
from rest_spec.build_index.corpora import CorpusSpec
from rest_spec.common.tokenizer import load_tokenizer, tokenizer_fingerprint
from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.datastore.client import DatastoreClient
from rest_spec.datastore.format import read_manifest
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.server import ServerConfig
from rest_spec.datastore.shards import format_shard_spec
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.protocol import Drafter
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.hf.generate import generate
from rest_spec.drafter.hf.measure import load_or_measure
from rest_spec.drafter.hf.model import load_model

log = logging.getLogger("benchmarks.sharded")

INDEX = INDEXES["sharegpt"][0].with_name("sharegpt-4shards")
SHARDS = 4  # what BUILD_ARGS make of the packaged corpus (~21.4M tokens)
BUILD_ARGS = [*INDEXES["sharegpt"][1], "--shard-tokens", "5500000"]
CONTEXT_SEED = 0
CALL_TIMEOUT = 60.0  # seconds per call: a batch through a router on a busy machine is slow, never this slow
WARM_TOKENS = 8  # the warm-up generation per mode


@dataclasses.dataclass(frozen=True)
class Topology:
    """A running server topology: the address clients draft from and every process serving it."""

    name: str
    address: str
    pids: tuple[int, ...]


def shard_specs(shards: int, servers: int) -> list[str]:
    """``servers`` shard specs of contiguous, evenly split shards covering ``0..shards-1``."""
    return [format_shard_spec(group.tolist()) for group in np.array_split(np.arange(shards), servers)]


@contextlib.contextmanager
def serving(index: Path, routers: Sequence[int], logs: Path, workers: int) -> Iterator[dict[str, Topology]]:
    """``serve`` and ``router/K`` for each K of ``routers`` over ``index``, all on free loopback
    ports with ``workers`` request threads; each process logs to its file in ``logs``. Stopped
    (routers before their shard servers) on exit."""
    shards = len(read_manifest(index).shards)
    with contextlib.ExitStack() as stack:

        def start(log_name: str, *args) -> tuple[int, str]:
            log_file = stack.enter_context(open(logs / f"{log_name}.log", "w+"))
            proc, address = start_datastore([*args, "--port", 0, "--workers", workers], log_file)
            stack.callback(stop, proc)
            return proc.pid, address

        pid, address = start("serve", "serve", "--index", index)
        topologies = {"serve": Topology("serve", address, (pid,))}
        for k in routers:
            servers = [
                start(f"router-{k}-shards-{spec}", "serve", "--index", index, "--shards", spec)
                for spec in shard_specs(shards, k)
            ]
            addresses = ",".join(address for _, address in servers)
            pid, address = start(
                f"router-{k}", "route", "--manifest", index / "manifest.json", "--shard-servers", addresses
            )
            topologies[f"router/{k}"] = Topology(f"router/{k}", address, (*(p for p, _ in servers), pid))
            log.info("router/%d at %s over %s", k, address, addresses)
        yield topologies


def batched(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def exactness(
    index: Path, topologies: Sequence[Topology], contexts: Sequence[list[int]], batch: int, config: DraftConfig
) -> dict:
    """Per topology, the contexts whose tree from ``DraftBatch`` calls of ``batch`` contexts
    differs from the in-process index's (``DraftTree`` equality: every field), with the first few
    of them; and how many contexts matched and were sampled, the router's second round."""
    with Datastore.open(index) as store:
        expected = [tree for part in batched(contexts, batch) for tree in store.draft_batch(part, config)]
    out = {
        "contexts": len(contexts),
        "batch": batch,
        "matched": sum(tree.match_len > 0 for tree in expected),
        "sampled": sum(tree.num_sampled < tree.num_matches for tree in expected),
        "mismatches": {},
        "first_mismatched_contexts": {},
    }
    for topology in topologies:
        with DatastoreClient(topology.address, timeout=CALL_TIMEOUT) as client:
            got: list[DraftTree] = [t for part in batched(contexts, batch) for t in client.draft_batch(part, config)]
        wrong = [i for i, (tree, want) in enumerate(zip(got, expected, strict=True)) if tree != want]
        out["mismatches"][topology.name] = len(wrong)
        out["first_mismatched_contexts"][topology.name] = [contexts[i] for i in wrong[:5]]
        log.info("exactness %s: %d of %d trees differ", topology.name, len(wrong), len(contexts))
    return out


def draft_latency(
    index: Path, topologies: Sequence[Topology], contexts: Sequence[list[int]], config: DraftConfig
) -> dict:
    """p50/p99 milliseconds of single draft calls of ``contexts`` (one client) per topology and in
    process, the topologies taking turns (``compare_latency``'s rounds)."""
    with Datastore.open(index) as store, contextlib.ExitStack() as stack:
        drafters = {"inprocess": store}
        for topology in topologies:
            drafters[topology.name] = stack.enter_context(DatastoreClient(topology.address, timeout=CALL_TIMEOUT))
        engines = {
            name: (lambda context, budget, d=drafter: d.draft(context, config)) for name, drafter in drafters.items()
        }
        figures = compare_latency(engines, list(contexts), [config.budget])[f"budget_{config.budget}"]
    return {name: {"p50_ms": f["median_ms"], "p99_ms": f["p99_ms"], "calls": f["calls"]} for name, f in figures.items()}


def throughput(
    topologies: Sequence[Topology],
    contexts: Sequence[list[int]],
    clients: Sequence[int],
    config: DraftConfig,
    *,
    seconds: float,
    warmup: float,
) -> dict:
    """Per topology and number of client processes (one client each), ``benchmarks.harness.servers.drive``'s
    figures; every topology in turn at each number of clients."""
    requests = draft_requests(list(contexts), config)
    out: dict[str, dict] = {topology.name: {} for topology in topologies}
    for n in clients:
        for topology in topologies:
            figures = drive(
                topology.address, requests, topology.pids, clients=n, processes=n, seconds=seconds, warmup=warmup
            )
            out[topology.name][str(n)] = figures
            log.info("%s, %d client(s): %.0f requests/s", topology.name, n, figures["requests_per_second"])
    return out


def generation(
    model,
    prompts: Sequence[list[int]],
    modes: dict[str, tuple[Drafter, bool]],
    cost: VerifyCost | None,
    config: DraftConfig,
    max_new_tokens: int,
    set_name: str | None = None,
) -> dict:
    """Every prompt decoded plainly (the reference) and then through an adaptive drafter per mode
    (``modes``: name -> (base drafter, overlap)), interleaved; per mode the summary (speeds as
    medians of per-prompt ratios, against plain and, when a mode is named ``serve``, against it).
    With ``set_name``, the plain outputs fill the replay benchmarks' greedy cache for that set."""
    drafters = {name: AdaptiveDrafter(base, cost=cost, config=config) for name, (base, _) in modes.items()}
    warm = prompts[0][:32]  # kernels, caches, channels; a throw-away drafter keeps calibrations clean
    generate(model, warm, None, max_new_tokens=WARM_TOKENS)
    for base, overlap in modes.values():
        throwaway = AdaptiveDrafter(base, cost=cost, config=config)
        generate(model, warm, throwaway, max_new_tokens=WARM_TOKENS, config=config, overlap=overlap)
    rows: dict[str, list[dict]] = {"plain": [], **{name: [] for name in modes}}
    plain_outputs = []
    for i, ids in enumerate(prompts):
        plain = generate(model, ids, None, max_new_tokens=max_new_tokens)
        plain_outputs.append(plain.output_ids)
        rows["plain"].append(record(plain, None))
        for name, drafter in drafters.items():
            result = generate(model, ids, drafter, max_new_tokens=max_new_tokens, config=config, overlap=modes[name][1])
            rows[name].append(record(result, plain))
        log.info(
            "prompt %d/%d: %s",
            i + 1,
            len(prompts),
            ", ".join(f"{m} {rows['plain'][-1]['seconds'] / rows[m][-1]['seconds']:.2f}x" for m in drafters),
        )
    if set_name is not None:
        save_greedy_outputs(greedy_path(model, set_name, prompts, max_new_tokens), list(zip(prompts, plain_outputs)))
    summary = {name: summarize(mode_rows, rows["plain"], None) for name, mode_rows in rows.items()}
    if "serve" in rows:
        for name, mode_rows in rows.items():
            summary[name]["speed_vs_serve"] = statistics.median(
                s["seconds"] / r["seconds"] for r, s in zip(mode_rows, rows["serve"])
            )
    return {"summary": summary, "per_prompt": rows}


def generation_modes(index: Path, topologies: Sequence[Topology], fingerprint: str | None, stack) -> dict:
    """``generation``'s modes: the index in process (overlap off) and every topology (overlap on),
    their drafters closed by ``stack``; none keeps outputs."""
    modes = {
        "inprocess": (
            stack.enter_context(LocalDrafter.open(index, outputs_max_tokens=0, expected_fingerprint=fingerprint)),
            False,
        )
    }
    for topology in topologies:
        drafter = stack.enter_context(RemoteDrafter(topology.address, expected_fingerprint=fingerprint))
        modes[topology.name] = (drafter, True)
    return modes


def evaluate_targets(report: dict) -> list[dict]:
    """The "sharded" targets of benchmarks/targets.json with the measured value and pass (None
    when not measured), as the retrieval benchmark lists them."""
    limits = load_targets("sharded")
    routers = report["exactness"]["mismatches"]
    speed = report["generation"]["summary"].get("router/4", {}).get("speed_vs_serve")
    targets = []
    for name, value, key in (
        (
            "held-out contexts a router drafts differently from the index (worst router)",
            max(routers.values(), default=None),
            "router_mismatches",
        ),
        ("generation through router/4 / through serve (median per-prompt speed)", speed, "router4_speed_vs_serve"),
    ):
        target = limits[key]
        targets.append(
            {
                "target": name,
                "value": value,
                "limit": target.get("max", target.get("min")),
                "at_most": "max" in target,
                "pass": None if value is None else bool(check(value, target)),
            }
        )
    return targets


def summary_lines(report: dict) -> list[str]:
    """The figures worth reading first, one line per topology, then the targets."""
    lines = []
    exact, latency = report["exactness"], report["draft_latency"]
    gen, load = report["generation"]["summary"], report["throughput"]
    lines.append(
        f"exactness: {exact['contexts']} held-out contexts, {exact['matched']} matched, {exact['sampled']} sampled"
    )
    for name in ("plain", *latency):
        parts = [f"{name:10}"]
        if name in latency:
            parts.append(f"draft p50 {latency[name]['p50_ms']:.3f} ms p99 {latency[name]['p99_ms']:.3f} ms")
        if name in load:
            parts.append("req/s " + " ".join(f"{n}:{f['requests_per_second']:.0f}" for n, f in load[name].items()))
        if name in exact["mismatches"]:
            parts.append(f"mismatches {exact['mismatches'][name]}")
        if name in gen:
            row = gen[name]
            parts.append(
                f"x plain {row['speed_vs_plain']:.3f} x serve {row.get('speed_vs_serve', float('nan')):.3f} "
                f"accepted {row['mean_accepted']:.2f} identical {row['identical']}/{row['prompts']}"
            )
        lines.append("  ".join(parts))
    for t in report["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[t["pass"]]
        bound = "<=" if t["at_most"] else ">="
        lines.append(f"target {verdict}: {t['target']}: {t['value']} ({bound} {t['limit']})")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, prompts_help="held-out ShareGPT prompts to generate from")
    p.add_argument(
        "--index",
        type=Path,
        default=INDEX,
        help=f"a sharded index built with --skip-last (default: %(default)s, built when missing with build_index {' '.join(BUILD_ARGS)})",
    )
    p.add_argument(
        "--contexts", type=int, default=5000, help="held-out contexts to compare and time (default: %(default)s)"
    )
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts (default: %(default)s)")
    p.add_argument(
        "--budget",
        type=int,
        default=64,
        help="draft budget of every call and of the adaptive drafter (default: %(default)s)",
    )
    p.add_argument(
        "--routers",
        type=comma_list(item=int),
        default="1,2,4",
        help="shard servers behind each router, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--clients",
        type=comma_list(item=int),
        default="1,2,3,4",
        help="client processes of the throughput runs (default: %(default)s)",
    )
    p.add_argument(
        "--batch", type=int, default=64, help="contexts per DraftBatch of the exactness check (default: %(default)s)"
    )
    p.add_argument(
        "--seconds", type=float, default=10.0, help="measured seconds per throughput run (default: %(default)s)"
    )
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (default: %(default)s)")
    p.add_argument(
        "--workers",
        type=int,
        default=ServerConfig.workers,
        help="request threads of every server (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"the JSON report (default, and only with every other default: {RESULTS / 'sharded.json'})",
    )
    args = finish_args(p, p.parse_args(argv))
    if args.out is None:
        defaults = finish_args(p, p.parse_args([]))
        flags = vars(p.parse_args([]))  # the flags' own values, none derived
        changed = sorted(f"--{k.replace('_', '-')}" for k in flags if getattr(args, k) != getattr(defaults, k))
        if changed:
            p.error(
                f"--out is needed with {', '.join(changed)} ({RESULTS / 'sharded.json'} holds runs with every default)"
            )
        args.out = RESULTS / "sharded.json"
    return args


def finish_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` checked and the draft parameters made (``p.error`` on a bad value)."""
    if min(args.routers) < 1 or min(args.clients) < 1:
        p.error("--routers and --clients must be positive")
    for name in ("contexts", "max_prompt_tokens", "batch", "workers", "seconds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        p.error("--warmup must not be negative")
    try:
        args.config = DraftConfig(budget=args.budget)
    except ValueError as exc:
        p.error(f"--budget: {exc}")
    return args


def run(args: argparse.Namespace, header: dict, logs: Path) -> dict:
    """Every part of the benchmark on ``args.index`` (``header``: the report's first keys,
    ``common.start_run``'s), the servers logging into ``logs``."""
    index = ensure_index(args.index, BUILD_ARGS)
    manifest = read_manifest(index)
    shards = len(manifest.shards)
    if shards != SHARDS:
        log.warning(
            "%s has %d shards, not the %d its build command makes: the figures are not comparable",
            index,
            shards,
            SHARDS,
        )
    if max(args.routers) > shards:
        raise SystemExit(f"{index} has {shards} shards: no router over {max(args.routers)} shard servers")
    tokenizer = load_tokenizer(None)
    fingerprint = tokenizer_fingerprint(tokenizer)
    contexts = sample_queries(CorpusSpec.from_dict(manifest.corpus["spec"]), args.contexts, CONTEXT_SEED, tokenizer)
    prompts = set_prompts("sharegpt", tokenizer, index, args.prompts, args.max_prompt_tokens)
    model = load_model(None)
    cost = load_or_measure(model)
    report = {
        **header,
        "index": {"path": str(index), "shards": shards, "tokens": manifest.num_tokens},
        "config": {
            "contexts": "16-token windows of the held-out conversations (never indexed), fixed seed",
            "budget": args.budget,
            "server_workers": args.workers,
            "routers": {f"router/{k}": shard_specs(shards, k) for k in args.routers},
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "generation": "greedy; AdaptiveDrafter per mode (overlap on through servers, off in process), "
            "calibration carried over between prompts, no outputs stored; modes interleaved per prompt",
        },
    }
    with serving(index, args.routers, logs, args.workers) as topologies, contextlib.ExitStack() as stack:
        remote = list(topologies.values())
        routers = [t for t in remote if t.name != "serve"]
        report["exactness"] = exactness(index, routers, contexts, args.batch, args.config)
        report["draft_latency"] = draft_latency(index, remote, contexts, args.config)
        report["throughput"] = throughput(
            remote, contexts, args.clients, args.config, seconds=args.seconds, warmup=args.warmup
        )
        modes = generation_modes(index, remote, fingerprint, stack)
        report["generation"] = generation(model, prompts, modes, cost, args.config, args.max_new_tokens, "sharegpt")
    report["targets"] = evaluate_targets(report)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = start_run("sharded", argv, format="%(asctime)s %(name)s: %(message)s")
    logs = Path(tempfile.mkdtemp(prefix="rest-sharded-logs-"))
    try:
        report = run(args, header, logs)
    except BaseException:
        log.error("the servers' logs are in %s", logs)
        raise
    differ = sum(r["prompts"] - r["identical"] for r in report["generation"]["summary"].values())
    mismatches = sum(report["exactness"]["mismatches"].values())
    if differ or mismatches:
        report["server_logs"] = str(logs)
    else:
        shutil.rmtree(logs)
    save_report(report, args.out, echo=False)
    print("\n".join(summary_lines(report)))
    print(f"saved {args.out}")
    if differ or mismatches:
        log.error(
            "%d outputs differ from plain decoding, %d router trees from the index's; logs in %s",
            differ,
            mismatches,
            logs,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
