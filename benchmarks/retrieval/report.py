"""The targets a run is checked against and the markdown tables it prints."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.harness.report import check, load_targets
from benchmarks.harness.retrieval_timing import BUDGETS, CLIENTS, GRPC_BUDGET, NODES_BUDGET


def evaluate_targets(report: dict) -> list[dict]:
    """The targets of benchmarks/targets.json, each with the measured value and pass (None when not
    measured)."""
    limits = load_targets("retrieval")
    chat = report["indexes"].get("sharegpt")
    targets: list[dict] = []

    def add(name: str, value: float | None, key: str) -> None:
        target = limits[key]
        passed = None if value is None else bool(check(value, target))
        targets.append(
            {
                "target": name,
                "value": value,
                "limit": target.get("max", target.get("min")),
                "at_most": "max" in target,
                "pass": passed,
            }
        )

    b64 = chat["in_process_latency"]["budget_64"] if chat else None
    add("sharegpt in-process draft, budget 64, median ms", b64 and b64["ours"]["median_ms"], "draft_median_ms")
    add("sharegpt in-process draft, budget 64, p99 ms", b64 and b64["ours"]["p99_ms"], "draft_p99_ms")
    add(
        "sharegpt in-process speedup over draftretriever (median, budget 64)",
        b64 and b64["speedup"],
        "speedup_over_draftretriever",
    )
    grpc = chat.get("grpc") if chat else None
    add(
        "sharegpt gRPC round trip, 1 client, median ms",
        grpc and grpc["clients"]["1"]["round_trip"]["median_ms"],
        "grpc_round_trip_median_ms",
    )
    add(
        "sharegpt gRPC throughput, 2 clients / 1 client",
        grpc and grpc["clients"]["2"]["throughput_vs_1_client"],
        "grpc_throughput_2_vs_1_clients",
    )
    sized = [(name, fig["open"]["ours"]) for name, fig in report["indexes"].items()]
    sized += [
        (f"sharegpt x{row['factor']}", row)
        for row in (report.get("growth") or {}).get("sizes", [])
        if row["factor"] != 1
    ]
    for name, fig in sized:
        add(f"{name} open seconds", fig["open_seconds"], "open_seconds")
        add(
            f"{name} resident memory added by open, % of index bytes",
            fig["rss_added_percent_of_index"],
            "open_rss_percent_of_index",
        )
    for name, fig in report["indexes"].items():
        add(f"{name} bytes on disk per token", fig["bytes_per_token"]["ours"], "bytes_per_token")
        add(
            f"{name} end-to-end build seconds, ours / draftretriever's",
            fig["build"]["ours"]["seconds"] / fig["build"]["draftretriever"]["seconds"],
            "build_seconds_vs_draftretriever",
        )
    growth = report.get("growth")
    if growth:
        largest = max(growth["sizes"], key=lambda row: row["tokens"])
        min_tokens = limits["growth_median_vs_base"]["min_tokens"]
        add(
            f"growth: median at {largest['tokens'] / 1e6:.0f}M tokens / at the ShareGPT index "
            f"(target needs >= {min_tokens / 1e6:.0f}M tokens)",
            largest["median_vs_base"] if largest["tokens"] >= min_tokens else None,
            "growth_median_vs_base",
        )
    return targets


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_table(report: dict) -> str:
    """Markdown tables (per-index figures, gRPC, growth, targets) for the README."""
    names = list(report["indexes"])
    header = "| figure | " + " | ".join(f"{n}: ours | draftretriever | ours/theirs" for n in names) + " |"
    lines = [header, "|---|" + "---:|" * (3 * len(names))]

    def row(label: str, get: Callable[[dict, str], float | None], digits: int = 3) -> None:
        cells = []
        for name in names:
            fig = report["indexes"][name]
            ours, theirs = get(fig, "ours"), get(fig, "draftretriever")
            ratio = ours / theirs if ours is not None and theirs else None
            cells += [_fmt(ours, digits), _fmt(theirs, digits), _fmt(ratio, 2)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for budget in BUDGETS:
        for stat in ("median_ms", "p99_ms"):
            row(
                f"draft, budget {budget}, {stat.replace('_ms', '')} (ms)",
                lambda f, e, b=budget, s=stat: f["in_process_latency"][f"budget_{b}"][e][s],
            )
    row(f"draft nodes at budget {NODES_BUDGET}, mean", lambda f, e: f["draft_nodes"][e]["mean"], 1)
    row(f"draft nodes at budget {NODES_BUDGET}, median", lambda f, e: f["draft_nodes"][e]["median"], 1)
    row("drafts with no node (%)", lambda f, e: f["draft_nodes"][e]["empty_percent"], 1)
    row("open (s)", lambda f, e: f["open"][e]["open_seconds"])
    row("resident memory added by open (MB)", lambda f, e: f["open"][e]["rss_added_bytes"] / 1e6, 1)
    row("... as % of index bytes", lambda f, e: f["open"][e]["rss_added_percent_of_index"], 2)
    row("bytes on disk per token", lambda f, e: f["bytes_per_token"][e], 2)
    row("build: tokenization (tokens/s)", lambda f, e: f["build"][e]["tokenize_tokens_per_second"], 0)
    row("build: suffix arrays (tokens/s)", lambda f, e: f["build"][e]["suffix_array_tokens_per_second"], 0)
    row("build: end to end (s)", lambda f, e: f["build"][e]["seconds"], 1)
    row("build: peak memory (MB)", lambda f, e: f["build"][e]["peak_rss_bytes"] / 1e6, 0)

    with_grpc = [n for n in names if "grpc" in report["indexes"][n]]
    if with_grpc:
        lines += [
            "",
            f"| gRPC, budget {GRPC_BUDGET} (ours) | " + " | ".join(with_grpc) + " |",
            "|---|" + "---:|" * len(with_grpc),
        ]
        grpcs = [report["indexes"][n]["grpc"]["clients"] for n in with_grpc]
        for stat in ("median_ms", "p99_ms"):
            lines.append(
                f"| round trip, 1 client, {stat.replace('_ms', '')} (ms) | "
                + " | ".join(_fmt(g["1"]["round_trip"][stat]) for g in grpcs)
                + " |"
            )
        for clients in CLIENTS:
            lines.append(
                f"| throughput, {clients} client(s) (requests/s) | "
                + " | ".join(
                    f"{g[str(clients)]['requests_per_second']:,.0f} (x{g[str(clients)]['throughput_vs_1_client']:.2f})"
                    for g in grpcs
                )
                + " |"
            )

    growth = report.get("growth")
    if growth:
        lines += [
            "",
            (
                "| growth (ShareGPT x f) | tokens | shards | median (ms) | p99 (ms) | median / x1 "
                "| open (s) | build (s) | build peak (MB) |"
            ),
            "|---|" + "---:|" * 8,
        ]
        for r in growth["sizes"]:
            peak = r["build_peak_rss_bytes"] and r["build_peak_rss_bytes"] / 1e6
            lines.append(
                f"| x{r['factor']} | {r['tokens']:,} | {r['shards']} | {_fmt(r['median_ms'])} | "
                f"{_fmt(r['p99_ms'])} | {_fmt(r['median_vs_base'], 2)} | {_fmt(r['open_seconds'])} | "
                f"{_fmt(r['build_seconds'], 1)} | {_fmt(peak, 0)} |"
            )

    lines += ["", "| target | value | limit | pass |", "|---|---:|---:|:---:|"]
    for t in report["targets"]:
        verdict = {True: "yes", False: "**no**", None: "n/a"}[t["pass"]]
        limit = f"{'<=' if t['at_most'] else '>='} {t['limit']:g}"
        lines.append(f"| {t['target']} | {_fmt(t['value'])} | {limit} | {verdict} |")
    return "\n".join(lines)
