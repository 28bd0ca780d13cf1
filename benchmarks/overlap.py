"""Drafting beside verification: in-process against remote drafting across added network latency,
overlap on and off, side by side; then a server killed halfway through a run.

    python -m benchmarks.overlap --prompts 40 --max-new-tokens 128 --rtts 0,1,2,5

The e2e sets (``benchmarks.harness.sets``: HumanEval with the python-stdlib index, held-out ShareGPT
first turns with the sharegpt index), greedy, the adaptive drafter. Per set, one ``rest-datastore
serve`` process, and per added round trip one ``benchmarks.harness.latency_proxy`` process in front of
it (every byte delayed by half the round trip each way). For every prompt the modes run back to
back (interleaved): ``plain`` (no drafts, the reference output and speed), ``local`` (the index in
process) and ``remote@R`` (through the proxy adding R ms), each with overlap ``on`` and ``off``.
Every mode has its own adaptive drafter for the whole set (its calibration carries over from
prompt to prompt); none stores outputs, so the output-store source is empty everywhere and every
mode sees the same sources.

Per mode: median per-prompt speed relative to plain, relative to ``local`` with the same overlap
setting, mean accepted length, the per-step time split (draft wait, forward + acceptance + cache
compaction), and ``drafting`` (share of steps whose draft was ready, wait median and p99,
fallbacks, cancellations). Then the fault run: a fresh server and a 2 ms proxy, the prompts
decoded with overlap; the server is killed (SIGKILL) in the middle of the middle prompt and
started again on the same port three quarters of the way through. Every output of every mode
and of the fault run must equal plain decoding (exit status 1 otherwise).

Prints the summary, saves JSON under benchmarks/results/ and a plot of speed against added
latency. A machine shared with other work makes every figure noisy: ratios are per prompt.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import StoppingCriteria

from benchmarks.harness.generation import record, summarize
from benchmarks.harness.report import (
    RESULTS,
    benchmark_parser,
    comma_list,
    pyplot,
    save_figure,
    save_report,
    start_run,
)
from benchmarks.harness.servers import start_proxy, start_server, stop
from benchmarks.harness.sets import DEFAULT_SETS, INDEXES, SETS, ensure_index, set_prompts
from rest_spec.common.tokenizer import load_tokenizer, tokenizer_fingerprint
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.hf.generate import generate
from rest_spec.drafter.hf.measure import load_or_measure
from rest_spec.drafter.hf.model import load_model

log = logging.getLogger("benchmarks.overlap")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, sets=SETS, default_sets=DEFAULT_SETS)
    p.add_argument(
        "--rtts", type=comma_list(item=float), default="0,1,2,5", help="added round trips in ms (default: %(default)s)"
    )
    p.add_argument("--budget", type=int, default=64, help="the adaptive drafter's candidates (default 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--no-fault-run", action="store_true", help="skip the killed-server run")
    p.add_argument("--out", type=Path, default=RESULTS / "overlap.json")
    p.add_argument("--plot", type=Path, default=RESULTS / "overlap.png")
    args = p.parse_args(argv)
    if min(args.rtts) < 0:
        p.error("--rtts must be non-negative")
    return args


class KillAt(StoppingCriteria):
    """Never stops generation; at its ``step``-th call (one per committed token) kills ``server``."""

    def __init__(self, step: int, server: subprocess.Popen) -> None:
        self.step, self.server, self.calls = step, server, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.step:
            self.server.kill()
            self.server.wait()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_set(name: str, prompts: list[list[int]], index: Path, model, cost, args, logs) -> dict:
    config = DraftConfig(budget=args.budget)
    fingerprint = tokenizer_fingerprint(load_tokenizer(None))
    server, address = start_server(index, 2, logs)
    proxies = {rtt: start_proxy(address, rtt) for rtt in args.rtts}
    bases = {"local": LocalDrafter.open(index, outputs_max_tokens=0, expected_fingerprint=fingerprint)}
    for rtt, (_, proxy_address) in proxies.items():
        bases[f"remote@{rtt:g}"] = RemoteDrafter(proxy_address, expected_fingerprint=fingerprint)
    drafters = {
        f"{where} {overlap}": AdaptiveDrafter(base, cost=cost, config=config)
        for where, base in bases.items()
        for overlap in ("on", "off")
    }
    rows: dict[str, list[dict]] = {"plain": [], **{mode: [] for mode in drafters}}
    plain_outputs = []
    try:
        for i, ids in enumerate(prompts):
            plain = generate(model, ids, None, max_new_tokens=args.max_new_tokens)
            plain_outputs.append(plain.output_ids)
            rows["plain"].append(record(plain, None))
            for mode, drafter in drafters.items():
                result = generate(
                    model, ids, drafter, max_new_tokens=args.max_new_tokens, config=config, overlap=mode.endswith("on")
                )
                rows[mode].append(record(result, plain))
            log.info(
                "%s %d/%d: %s",
                name,
                i + 1,
                len(prompts),
                ", ".join(f"{m} {rows['plain'][-1]['seconds'] / rows[m][-1]['seconds']:.2f}x" for m in drafters),
            )
        summary = {"plain": summarize(rows["plain"], rows["plain"], None)}
        for mode in drafters:
            summary[mode] = summarize(rows[mode], rows["plain"], rows[f"local {mode.split()[-1]}"])
        fault = None if args.no_fault_run else fault_run(prompts, plain_outputs, index, model, cost, config, args, logs)
    finally:
        for base in bases.values():
            base.close()
        for proc, _ in proxies.values():
            stop(proc)
        stop(server)
    return {"summary": summary, "fault_run": fault, "per_prompt": rows}


def fault_run(prompts, plain_outputs, index: Path, model, cost, config, args, logs) -> dict:
    """Remote drafting at 2 ms with overlap: the server killed in the middle of the middle prompt,
    back on the same port three quarters of the way through."""
    server, address = start_server(index, 2, logs)
    port = int(address.rsplit(":", 1)[1])
    proxy, proxy_address = start_proxy(address, 2.0)
    kill_at, restart_at = len(prompts) // 2, (3 * len(prompts)) // 4
    per_prompt = []
    try:
        with RemoteDrafter(proxy_address) as base:
            drafter = AdaptiveDrafter(base, cost=cost, config=config)
            for i, ids in enumerate(prompts):
                if i == restart_at and i > kill_at:
                    server, _ = start_server(index, 2, logs, port=port)
                criteria = [KillAt(10, server)] if i == kill_at else None
                result = generate(
                    model,
                    ids,
                    drafter,
                    max_new_tokens=args.max_new_tokens,
                    config=config,
                    stopping_criteria=criteria,
                    overlap=True,
                )
                per_prompt.append(
                    {
                        "identical": result.output_ids == plain_outputs[i],
                        "server": "killed mid-generation"
                        if i == kill_at
                        else ("down" if kill_at < i < restart_at else "up"),
                        "mean_accepted": result.mean_accepted,
                        **{k: result.drafting.summary()[k] for k in ("fallbacks", "cancelled", "predicted_share")},
                    }
                )
    finally:
        stop(proxy)
        stop(server)
    return {
        "kill_at_prompt": kill_at,
        "restart_at_prompt": restart_at,
        "identical": sum(p["identical"] for p in per_prompt),
        "prompts": len(per_prompt),
        "per_prompt": per_prompt,
    }


def plot(report: dict, rtts: list[float], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    sets = list(report["sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    for ax, name in zip(axes[0], sets):
        summary = report["sets"][name]["summary"]
        for overlap, style in (("on", "-o"), ("off", "--s")):
            ys = [summary[f"remote@{rtt:g} {overlap}"]["speed_vs_plain"] for rtt in rtts]
            (line,) = ax.plot(rtts, ys, style, label=f"remote, overlap {overlap}")
            ax.axhline(summary[f"local {overlap}"]["speed_vs_plain"], color=line.get_color(), alpha=0.4, linestyle=":")
        ax.set_title(f"{name}: dotted = in-process")
        ax.set_xlabel("added round trip (ms)")
        ax.set_ylabel("speed vs plain decoding (median)")
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path, dpi=110)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = start_run("overlap", argv)
    logging.getLogger("rest_spec").setLevel(logging.ERROR)  # the fault run's fallback warnings
    model, tokenizer = load_model(None), load_tokenizer(None)
    cost = load_or_measure(model)
    report = {
        **header,
        "config": {
            "prompts_per_set": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "rtts_ms": args.rtts,
            "budget": args.budget,
            "threads": os.cpu_count(),
        },
        "sets": {},
    }
    with tempfile.TemporaryFile("w+") as logs:
        for name in args.sets:
            index = ensure_index(INDEXES[name][0], INDEXES[name][1])
            prompts = set_prompts(name, tokenizer, index, args.prompts, args.max_prompt_tokens)
            report["sets"][name] = run_set(name, prompts, index, model, cost, args, logs)
    failures = 0
    for name, result in report["sets"].items():
        for mode, row in result["summary"].items():
            failures += row["prompts"] - row["identical"]
            print(
                f"{name:10} {mode:16} x plain {row['speed_vs_plain']:.3f}  x local {row.get('speed_vs_local', 1):.3f}  "
                f"accepted {row['mean_accepted']:.2f}  ready {row['ready_share']:.2f}  wait p50 "
                f"{row['wait_ms_median']:.3f} ms p99 {row['wait_ms_p99']:.2f} ms  fallbacks {row['fallbacks']}  "
                f"identical {row['identical']}/{row['prompts']}"
            )
        if result["fault_run"] is not None:
            fault = result["fault_run"]
            failures += fault["prompts"] - fault["identical"]
            print(f"{name:10} fault run: identical {fault['identical']}/{fault['prompts']}")
    report["plot"] = str(args.plot) if plot(report, args.rtts, args.plot) else None
    save_report(report, args.out, echo=False)
    print(f"saved {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
