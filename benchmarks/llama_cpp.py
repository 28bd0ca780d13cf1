"""llama.cpp, side by side: its plain decoding, its prompt lookup, and this project's drafter in it.

    python -m benchmarks.llama_cpp --prompts 40 --max-new-tokens 128

The packaged SmolLM2-135M-Instruct GGUF through llama-cpp-python (``--threads`` for one-token steps
and batches), greedy, on the e2e sets (``benchmarks.harness.sets``): the first N HumanEval prompts with the
python-stdlib index, the first user turns of N held-out ShareGPT conversations with the sharegpt
index. For every prompt the modes run back to back (interleaved):

- ``llama``: ``Llama.generate`` without a draft model, the reference output and speed;
- ``llama-pld``: llama.cpp's own prompt lookup, ``LlamaPromptLookupDecoding(num_pred_tokens=10)``;
- ``llama-rest``: ``rest_llama`` with the index in process (``RestDraftModel``: index, request text
  and recent outputs merged, the chain sized by llama.cpp's measured t(n));
- ``llama-rest-grpc``: the same drafting from a ``rest-datastore serve`` process on loopback;
- ``llama-rest-frozen``, ``llama-rest-killed``: the same, from a server of its own that is stopped
  (SIGSTOP) or killed (SIGKILL) once the first prompt is done: what a dead datastore costs (the
  steps' deadlines, then its circuit breaker; drafting goes on from the request's own text);
- ``llama-oracle``: the ceiling: a draft model that knows ``llama``'s output for the prompt and
  drafts its next ``--oracle-tokens`` tokens every step (all accepted), in a ``RestLlama`` (prompt
  logits at the last position only, as ``llama-rest``): what any drafter of chains that long could
  reach with llama.cpp on this machine;
- ``transformers``: transformers' ``model.generate`` (greedy, fp32) for scale, on every
  ``--transformers-every``-th prompt (it runs at a fifth of llama.cpp's speed and would dominate the run).

The rest modes' output stores get each of their outputs after its prompt, as a service's would.
Per mode: mean accepted tokens per llama.cpp evaluation, median tokens/s, the median of per-prompt
speed ratios against ``llama``, and how many outputs equal ``llama``'s (llama.cpp built with its
llamafile kernels rounds batches differently from one-token steps, so drafting modes may differ
there; the README's build turns them off). Prints one JSON object, saves it under
benchmarks/results/, and plots speed per mode (needs matplotlib). t(n) comes from
``load_or_measure_llama`` (cached per model file, threads and build; measure on a quiet machine).
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness.generation import hf_run
from benchmarks.harness.report import (
    RESULTS,
    benchmark_parser,
    check,
    comma_list,
    load_targets,
    mode_bars,
    pyplot,
    save_figure,
    save_report,
    start_run,
)
from benchmarks.harness.servers import start_server, stop
from benchmarks.harness.sets import add_set_arguments, set_index, set_prompts
from rest_spec.common.tokenizer import load_tokenizer, packaged_smollm2, tokenizer_fingerprint
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.llamacpp.draft_model import (
    LlamaGeneration,
    RestDraftModel,
    llama_generate,
    require_llama_cpp,
    rest_llama,
)

log = logging.getLogger("benchmarks.llama_cpp")

MODES = (
    "llama",
    "llama-pld",
    "llama-rest",
    "llama-rest-grpc",
    "llama-rest-frozen",
    "llama-rest-killed",
    "llama-oracle",
    "transformers",
)
FAULTS = {"llama-rest-frozen": signal.SIGSTOP, "llama-rest-killed": signal.SIGKILL}  # sent after the first prompt
DEFAULT_MODES = ("llama", "llama-pld", "llama-rest", "llama-rest-grpc", "transformers")
PROMPT_LOOKUP_TOKENS = 10


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, sets=("humaneval", "sharegpt"))
    p.add_argument(
        "--modes",
        type=comma_list(MODES),
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, of {','.join(MODES)} (default: %(default)s; llama always runs)",
    )
    p.add_argument("--oracle-tokens", type=int, default=7, help="the llama-oracle mode's chain length")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default: %(default)s)")
    p.add_argument(
        "--transformers-every", type=int, default=4, metavar="K", help="run transformers on every K-th prompt"
    )
    add_set_arguments(p)
    p.add_argument("--budget", type=int, default=64, help="candidates per source for the rest modes")
    p.add_argument("--max-depth", type=int, default=32, help="the longest chain the rest modes draft")
    p.add_argument("--out", type=Path, default=RESULTS / "llama_cpp.json")
    p.add_argument("--plot", type=Path, default=RESULTS / "llama_cpp.png")
    args = p.parse_args(argv)
    args.modes = ["llama"] + [m for m in args.modes if m != "llama"]
    return args


def row(run: LlamaGeneration, reference: LlamaGeneration) -> dict:
    return {
        "new_tokens": len(run.output_ids),
        "steps": run.steps,
        "mean_accepted": run.mean_accepted,
        "tokens_per_second": run.tokens_per_second,
        "seconds": run.seconds,
        "speed_vs_llama": run.tokens_per_second / reference.tokens_per_second,
        "same_as_llama": run.output_ids == reference.output_ids,
    }


class Oracle:
    """A draft model for ``RestLlama`` that drafts the next ``tokens`` tokens of a known output."""

    def __init__(self, tokens: int) -> None:
        self.tokens, self.full, self.last_chain = tokens, [], np.zeros(0, np.intc)

    def __call__(self, input_ids, /, **kwargs) -> np.ndarray:
        n = len(input_ids)
        self.last_chain = np.array(self.full[n : n + self.tokens], np.intc)
        return self.last_chain

    drafted = RestDraftModel.drafted

    def observe(self, tokens: int, seconds: float) -> None:
        pass


def run_set(name: str, prompts: list[list[int]], index: Path, args: argparse.Namespace, logs) -> dict:
    """Every mode on every prompt of one set, interleaved."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from rest_spec.drafter.llamacpp.draft_model import RestLlama

    model_path = str(packaged_smollm2())
    options = {
        "n_ctx": max(map(len, prompts)) + args.max_new_tokens + args.max_depth + 1,
        "n_threads": args.threads,
        "n_threads_batch": args.threads,
        "verbose": False,
    }
    config = DraftConfig(budget=args.budget, max_depth=args.max_depth)
    llamas: dict[str, llama_cpp.Llama] = {"llama": llama_cpp.Llama(model_path, **options)}
    server = None
    if "llama-pld" in args.modes:  # logits_all: llama-cpp-python's buffer for drafts (see drafter.llamacpp.draft_model)
        pld = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS)
        llamas["llama-pld"] = llama_cpp.Llama(model_path, draft_model=pld, logits_all=True, **options)
    if "llama-rest" in args.modes:
        llamas["llama-rest"] = rest_llama(model_path, LocalDrafter.open(index), config=config, **options)
    oracle = Oracle(args.oracle_tokens)
    if "llama-oracle" in args.modes:
        llamas["llama-oracle"] = RestLlama(model_path, draft_model=oracle, logits_all=True, **options)
    if "llama-rest-grpc" in args.modes:
        server, address = start_server(index, 2, logs)
        llamas["llama-rest-grpc"] = rest_llama(model_path, RemoteDrafter(address), config=config, **options)
    doomed = {}  # mode -> the server it will lose
    for mode in FAULTS.keys() & set(args.modes):
        doomed[mode], address = start_server(index, 2, logs)
        llamas[mode] = rest_llama(model_path, RemoteDrafter(address), config=config, **options)
    transformers = None
    if "transformers" in args.modes:
        from rest_spec.drafter.hf.model import load_model

        transformers = load_model(None, device="cpu")
    try:
        runs: dict[str, Callable[[list[int]], LlamaGeneration]] = {
            mode: (lambda ids, llm=llm: llama_generate(llm, ids, args.max_new_tokens)) for mode, llm in llamas.items()
        }
        if transformers is not None:

            def transformers_run(ids: list[int]) -> LlamaGeneration:
                run = hf_run(transformers, ids, args.max_new_tokens)
                eos = transformers.generation_config.eos_token_id
                output = run.output_ids[:-1] if run.output_ids and run.output_ids[-1] == eos else run.output_ids
                return LlamaGeneration(output, run.seconds, run.steps)

            runs["transformers"] = transformers_run
        warm = prompts[0][:32]
        for mode in args.modes:  # caches, threads, allocator; no outputs stored
            runs[mode](warm)
        rows: dict[str, list[dict]] = {mode: [] for mode in args.modes}
        for i, ids in enumerate(prompts):
            reference = runs["llama"](ids)
            oracle.full = list(ids) + reference.output_ids
            for mode in args.modes:
                if mode == "transformers" and i % args.transformers_every:
                    continue
                run = reference if mode == "llama" else runs[mode](ids)
                rows[mode].append({"prompt": i, "prompt_tokens": len(ids), **row(run, reference)})
                if mode.startswith("llama-rest") and run.output_ids and mode not in FAULTS:
                    llamas[mode].draft_model.add_output(run.output_ids)
            if i == 0:
                for mode, proc in doomed.items():
                    proc.send_signal(FAULTS[mode])
            log.info(
                "%s %d/%d: %s",
                name,
                i + 1,
                len(prompts),
                ", ".join(
                    f"{m} {rows[m][-1]['mean_accepted']:.2f} x{rows[m][-1]['speed_vs_llama']:.2f}"
                    for m in rows
                    if rows[m] and rows[m][-1]["prompt"] == i
                ),
            )
        result = {
            "index": str(index),
            "prompts": len(prompts),
            "modes": {mode: summarize(mode_rows) for mode, mode_rows in rows.items()},
            "per_prompt": rows,
        }
        for mode in doomed:  # the prompts after the fault: their time against llama.cpp alone's
            after = [r["prompt"] for r in rows[mode] if r["prompt"] > 0]
            seconds = {m: sum(r["seconds"] for r in rows[m] if r["prompt"] in after) for m in (mode, "llama")}
            result["modes"][mode]["time_vs_llama_after_fault"] = seconds[mode] / seconds["llama"] if after else None
        for mode in ("llama-rest", "llama-rest-grpc", *FAULTS):
            if mode in llamas:
                stats = llamas[mode].draft_model.stats
                asked = max(stats.calls - stats.skipped, 1)
                result["modes"][mode].update(
                    draft_ms_per_draft=1e3 * stats.seconds / asked,
                    drafted_per_draft=stats.drafted / asked,
                    skipped_share=stats.skipped / max(stats.calls, 1),
                )
        return result
    finally:
        for llm in llamas.values():
            if getattr(llm, "draft_model", None) is not None and hasattr(llm.draft_model, "close"):
                llm.draft_model.close()
        if server is not None:
            stop(server)
        for proc in doomed.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
            stop(proc)


def summarize(rows: list[dict]) -> dict:
    tokens, steps = sum(r["new_tokens"] for r in rows), sum(r["steps"] for r in rows)
    return {
        "mean_accepted": tokens / steps,
        "median_tokens_per_second": statistics.median(r["tokens_per_second"] for r in rows),
        "median_speed_vs_llama": statistics.median(r["speed_vs_llama"] for r in rows),
        "same_as_llama": sum(r["same_as_llama"] for r in rows),
    }


def targets(report: dict) -> dict:
    limits, out = load_targets("llama_cpp"), {}
    for name, result in report["sets"].items():
        for mode in ("llama-rest", "llama-rest-grpc"):
            if mode in result["modes"]:
                target = limits[f"{mode.replace('-', '_')}_speed_vs_llama_{name}"]
                out[f"{name}: {mode} median speed >= {target['min']}x llama"] = check(
                    result["modes"][mode]["median_speed_vs_llama"], target
                )
        for mode in FAULTS:
            ratio = result["modes"].get(mode, {}).get("time_vs_llama_after_fault")
            if ratio is not None:
                target = limits[f"{mode.replace('-', '_')}_time_vs_llama_{name}"]
                out[f"{name}: {mode} time after the fault <= {target['max']}x llama"] = check(ratio, target)
    return out


def plot(report: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(8, 4))
    mode_bars(axis, report, MODES, "median_speed_vs_llama", "speed vs llama.cpp plain decoding (median per prompt)")
    axis.legend(fontsize=8)
    figure.suptitle(
        f"SmolLM2-135M-Instruct Q4_1 GGUF, greedy, {report['config']['max_new_tokens']} new tokens, "
        f"{report['config']['threads']} threads",
        fontsize=9,
    )
    save_figure(figure, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = start_run("llama_cpp", argv)
    require_llama_cpp()
    import llama_cpp

    tokenizer = load_tokenizer(None)
    report = {
        **header,
        "config": {
            "model": "SmolLM2-135M-Instruct (packaged Q4_1 GGUF)",
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_build": llama_cpp.llama_print_system_info().decode(),
            "threads": args.threads,
            "greedy": True,
            "prompts_per_set": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "budget": args.budget,
            "max_depth": args.max_depth,
            "modes": args.modes,
            "transformers_every": args.transformers_every,
        },
        "sets": {},
    }
    fingerprint = tokenizer_fingerprint(tokenizer)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "llama_cpp_server.log", "w") as logs:
        for name in args.sets:
            index = set_index(name, args)
            with LocalDrafter.open(index, expected_fingerprint=fingerprint):
                pass  # a foreign index fails here, before any model loads
            prompts = set_prompts(name, tokenizer, index, args.prompts, args.max_prompt_tokens, args.skip_prompts)
            report["sets"][name] = run_set(name, prompts, index, args, logs)
    report["targets"] = targets(report)
    report["plot"] = str(args.plot) if plot(report, args.plot) else None
    save_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
