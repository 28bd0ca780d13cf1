"""A datastore that dies or freezes mid-generation, as ``rest-generate`` users meet it: total time
against ``--no-draft``, outputs, exit statuses, and how soon drafting resumes once it is back.

    python -m benchmarks.faults --prompts 10 --max-new-tokens 128

The first N HumanEval prompts, greedy, the python-stdlib index behind ``rest-datastore serve``,
``rest-generate --adaptive -v`` (``--no-adaptive``: REST's fixed trees). Each prompt runs in a
``rest-generate`` process of its own, against a server of its own, so every fault hits a known
state; the modes run prompt by prompt, interleaved:

    no-draft   ``rest-generate --no-draft``: the reference output and time
    healthy    ``--datastore HOST:PORT``, the server up throughout
    killed     the server killed (SIGKILL) ``--fault-at`` seconds into the prompt (a new one for the next)
    frozen     the server frozen (SIGSTOP) ``--fault-at`` seconds into the prompt, resumed after it ends
    recovery   the server frozen ``--freeze-at`` seconds into the prompt and resumed (SIGCONT)
               ``--hold`` seconds after the client's circuit breaker opened (its log line; on a busy
               machine steps are slow, and the few failed ones that open it take long): seconds from
               SIGCONT to its "answers again" line (a probe, a real draft call, was answered)

A prompt's time runs from its "generating" log line (model loading is not timed) to the process's
exit, so the end of a prompt (storing the output) and of the process count. A fault that comes
after the prompt's last step changes nothing: ``landed`` counts the prompts it hit mid-generation.
Before timing, one untimed run measures the verify cost if it is not cached and warms the caches.
Prints the summary and saves JSON (``--out``); exit status 1 when an output differs from
``--no-draft``'s or a run fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.report import (
    REPO,
    RESULTS,
    benchmark_parser,
    check,
    comma_list,
    load_targets,
    save_report,
    start_run,
)
from benchmarks.harness.servers import start_server
from benchmarks.harness.sets import STDLIB_INDEX, ensure_index, humaneval_prompts

log = logging.getLogger("benchmarks.faults")

MODES = ("no-draft", "healthy", "killed", "frozen", "recovery")
# rest-generate -v's log lines the benchmark times (drafter.cli.rest_generate, drafter.core.breaker)
STARTED, OPENED, RESUMED = "generating 1/1", "calls in a row", "answers again"
WORKERS = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, prompts=10, prompts_help="HumanEval prompts")
    p.add_argument(
        "--modes", type=comma_list(MODES), default=",".join(MODES), help="comma-separated (default: %(default)s)"
    )
    p.add_argument("--fault-at", type=float, default=3.0, help="seconds into a prompt (default: %(default)s)")
    p.add_argument("--freeze-at", type=float, default=0.5, help="recovery mode (default: %(default)s)")
    p.add_argument(
        "--hold",
        type=float,
        default=1.0,
        help="recovery mode: seconds frozen after the breaker opened (default: %(default)s)",
    )
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--index", type=Path, default=STDLIB_INDEX[0])
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take before it is killed")
    p.add_argument("--out", type=Path, default=RESULTS / "faults.json")
    args = p.parse_args(argv)
    if "no-draft" not in args.modes:
        p.error(f"--modes must be a comma-separated subset of {','.join(MODES)}, no-draft included")
    if min(args.fault_at, args.freeze_at, args.hold) < 0:
        p.error("--fault-at, --freeze-at and --hold must be non-negative")
    return args


@dataclass
class Run:
    """One ``rest-generate`` process as the benchmark saw it: ``time.monotonic()`` when each line
    of interest came, the fault's own times, the JSON record, the exit status."""

    started: float | None = None
    printed: float | None = None  # its JSON line
    opened: float | None = None
    resumed: float | None = None
    fault: float | None = None  # SIGKILL or SIGSTOP sent
    back: float | None = None  # SIGCONT sent
    record: dict | None = None
    status: int | None = None
    ended: float | None = None
    log: list[str] = field(default_factory=list)


def run_prompt(prompt: str, args: argparse.Namespace, datastore: str | None, fault: Callable[[Run], None]) -> Run:
    """``rest-generate`` on ``prompt`` (``--no-draft`` without a ``datastore``); ``fault(run)`` runs
    in a thread of its own once the prompt starts generating."""
    source = ["--no-draft"] if datastore is None else ["--datastore", datastore, *(["--adaptive"] * args.adaptive)]
    argv = [sys.executable, "-m", "rest_spec.drafter", "--prompt", prompt, "--json", "-v"]
    argv += ["--max-new-tokens", str(args.max_new_tokens), *source]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    run = Run()

    def read_log() -> None:
        for line in proc.stderr:
            now = time.monotonic()
            run.log.append(line.rstrip("\n"))
            if run.started is None and STARTED in line:
                run.started = now
                threading.Thread(target=fault, args=(run,), daemon=True).start()
            elif run.opened is None and OPENED in line:
                run.opened = now
            elif RESUMED in line and run.back is not None and run.resumed is None:
                run.resumed = now

    def read_output() -> None:
        for line in proc.stdout:
            if line.strip():
                run.printed, run.record = time.monotonic(), json.loads(line)

    readers = [threading.Thread(target=read_log, daemon=True), threading.Thread(target=read_output, daemon=True)]
    for reader in readers:
        reader.start()
    try:
        run.status = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        run.status = "timeout"
    run.ended = time.monotonic()
    for reader in readers:
        reader.join(timeout=10)
    return run


def no_fault(run: Run) -> None:
    pass


def strike(server: subprocess.Popen, how: int, at: float) -> Callable[[Run], None]:
    """A fault: ``how`` (SIGKILL, SIGSTOP) sent to ``server`` ``at`` seconds into the prompt."""

    def fault(run: Run) -> None:
        time.sleep(max(run.started + at - time.monotonic(), 0))
        if server.poll() is None:
            server.send_signal(how)
            run.fault = time.monotonic()

    return fault


def freeze_and_resume(server: subprocess.Popen, at: float, hold: float) -> Callable[[Run], None]:
    """SIGSTOP ``at`` seconds into the prompt, SIGCONT ``hold`` seconds after the breaker opened
    (or once the prompt is over)."""

    def fault(run: Run) -> None:
        strike(server, signal.SIGSTOP, at)(run)
        if run.fault is None:  # the prompt was over
            return
        while run.opened is None and run.printed is None:
            time.sleep(0.01)
        time.sleep(max((run.opened or time.monotonic()) + hold - time.monotonic(), 0))
        server.send_signal(signal.SIGCONT)
        run.back = time.monotonic()

    return fault


def stop(server: subprocess.Popen) -> None:
    """A server gone for good, whatever its state (a frozen one is resumed first)."""
    if server.poll() is None:
        server.send_signal(signal.SIGCONT)
        server.kill()
    server.wait()


def run_mode(mode: str, prompt: str, args: argparse.Namespace, server_log) -> Run:
    if mode == "no-draft":
        return run_prompt(prompt, args, None, no_fault)
    server, address = start_server(args.index, WORKERS, server_log)
    try:
        fault = {
            "healthy": no_fault,
            "killed": strike(server, signal.SIGKILL, args.fault_at),
            "frozen": strike(server, signal.SIGSTOP, args.fault_at),
            "recovery": freeze_and_resume(server, args.freeze_at, args.hold),
        }[mode]
        return run_prompt(prompt, args, address, fault)
    finally:
        stop(server)


def row(run: Run, reference: Run | None) -> dict:
    """One run's figures."""
    record = run.record or {}
    out = {
        "status": run.status,
        "identical": reference is None
        or (
            record.get("output_ids") is not None
            and record.get("output_ids") == (reference.record or {}).get("output_ids")
        ),
        "seconds": None if run.started is None else run.ended - run.started,
        "generate_seconds": record.get("seconds"),
        "after_output_seconds": None if run.printed is None else run.ended - run.printed,
        "new_tokens": record.get("new_tokens"),
        "steps": record.get("steps"),
        "drafting": record.get("drafting"),
        "fault_landed": run.fault is not None and run.printed is not None and run.fault < run.printed,
        "breaker_opened": run.opened is not None,
    }
    if run.back is not None:
        out["recovery_seconds"] = None if run.resumed is None else run.resumed - run.back
        out["resumed_mid_generation"] = (
            run.resumed is not None and run.printed is not None and run.resumed < run.printed
        )
    return out


def summarize(rows: list[dict], plain: list[dict]) -> dict:
    total = sum(r["seconds"] or 0 for r in rows)
    plain_total = sum(p["seconds"] or 0 for p in plain)
    out = {
        "prompts": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "exit_statuses": dict(Counter(str(r["status"]) for r in rows)),
        "total_seconds": total,
        "vs_no_draft": total / plain_total if plain_total else None,
        "median_prompt_vs_no_draft": statistics.median(
            r["seconds"] / p["seconds"] for r, p in zip(rows, plain) if r["seconds"] and p["seconds"]
        ),
        "faults_landed": sum(r["fault_landed"] for r in rows),
        "breaker_opened": sum(r["breaker_opened"] for r in rows),
        "after_output_seconds_max": max((r["after_output_seconds"] or 0) for r in rows),
    }
    drafting = [r["drafting"] for r in rows if r["drafting"]]
    for key in ("steps", "fallbacks", "cancelled", "breaker_open_steps", "probes"):
        out[key] = sum(d.get(key, 0) for d in drafting)
    recoveries = [r["recovery_seconds"] for r in rows if r.get("recovery_seconds") is not None]
    if any("recovery_seconds" in r for r in rows):
        out["recovered"] = len(recoveries)
        out["recovery_seconds"] = recoveries
        out["recovery_seconds_median"] = statistics.median(recoveries) if recoveries else None
        out["recovery_seconds_max"] = max(recoveries) if recoveries else None
    return out


def targets(summary: dict) -> dict:
    """Each target with the measured value and whether it passes (None: its mode did not run)."""
    values = {
        "killed_vs_no_draft": summary.get("killed", {}).get("vs_no_draft"),
        "frozen_vs_no_draft": summary.get("frozen", {}).get("vs_no_draft"),
        "recovery_seconds_max": summary.get("recovery", {}).get("recovery_seconds_max"),
    }
    return {
        name: {**target, "value": values[name], "pass": None if values[name] is None else check(values[name], target)}
        for name, target in load_targets("faults").items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = start_run("faults", argv)
    ensure_index(args.index, STDLIB_INDEX[1])
    load_before, loads = os.getloadavg(), []  # what else ran on the machine
    prompts = humaneval_prompts(args.prompts)
    rows: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    failures = 0
    with tempfile.TemporaryFile("w+") as server_log:
        warmup = run_mode(
            "healthy", "def fibonacci(n):", argparse.Namespace(**{**vars(args), "max_new_tokens": 8}), server_log
        )
        if warmup.status != 0:
            raise SystemExit("the warm-up run failed:\n" + "\n".join(warmup.log[-20:]))
        for i, prompt in enumerate(prompts):
            runs = {mode: run_mode(mode, prompt, args, server_log) for mode in args.modes}
            loads.append(os.getloadavg()[0])
            for mode, run in runs.items():
                rows[mode].append(row(run, None if mode == "no-draft" else runs["no-draft"]))
                failures += run.status != 0 or not rows[mode][-1]["identical"]
            log.info(
                "prompt %d/%d: %s",
                i + 1,
                len(prompts),
                ", ".join(f"{m} {r[-1]['seconds'] or 0:.2f} s" for m, r in rows.items()),
            )
    summary = {mode: summarize(mode_rows, rows["no-draft"]) for mode, mode_rows in rows.items()}
    load_after = os.getloadavg()
    report = {
        **header,
        "config": {
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "adaptive": args.adaptive,
            "fault_at": args.fault_at,
            "freeze_at": args.freeze_at,
            "hold": args.hold,
            "index": str(args.index),
            "server_workers": WORKERS,
            "cpus": os.cpu_count(),
            "load_average_before": load_before,  # 1, 5 and 15 minutes
            "load_average_after": load_after,
            "load_average_1min_per_prompt": loads,
        },
        "targets": targets(summary),
        "summary": summary,
        "per_prompt": rows,
    }
    for mode, s in summary.items():
        recovery = ""
        if "recovered" in s:
            recovery = f"  recovered {s['recovered']}/{s['prompts']}, median {s['recovery_seconds_median']} s, max {s['recovery_seconds_max']} s"
        print(
            f"{mode:9} total {s['total_seconds']:7.2f} s  x no-draft {s['vs_no_draft']:.3f}  identical "
            f"{s['identical']}/{s['prompts']}  exit {s['exit_statuses']}  faults landed {s['faults_landed']}  "
            f"breaker opened {s['breaker_opened']}  open steps {s['breaker_open_steps']}/{s['steps']}  "
            f"probes {s['probes']}{recovery}"
        )
    for name, target in report["targets"].items():
        print(f"target {name}: {target['value']} (max {target['max']}): {target['pass']}")
    save_report(report, args.out, echo=False)
    print(f"saved {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
