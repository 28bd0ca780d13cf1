"""What sampling the drafted positions of a vLLM verification costs on the CPU: vLLM's rejection
sampler as shipped against the REST proposer's, which does not sort the vocabulary.

    .venv-vllm/bin/python -m benchmarks.verify_sampling --rows 1,8 --positions 1,3 --out benchmarks/results/sampled/verify_sampling.json

For R sampled requests (each with its own seed, as the benchmarks' requests have) of P drafted
positions each, on SmolLM2's 49,152-token vocabulary at temperature 0.7 and top-p 0.95 (``--top-k``
adds a top-k), medians of ``--repeats`` calls of each function as the rejection sampler calls it:

- top-k/top-p: vLLM 0.32's ``apply_top_k_top_p`` (on the CPU it sorts every row) against
  ``drafter.vllm.sampling.apply_top_k_top_p``;
- recovered tokens: vLLM's ``sample_recovered_tokens`` (an exponential draw for every token of the
  vocabulary per request, again for each seeded request, then its CPU kernel) against the
  proposer's (``recovered_tokens_sampler``: one uniform draw a position, inverse transform).

The logits are the packaged SmolLM2's at positions of real code (one forward over this module's
source). What the difference is worth in a whole engine step (where the model's forward costs
far more on a slow CPU): ``benchmarks.vllm``'s ``rest`` against ``rest-sort``. Prints a table and
saves JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.harness.report import RESULTS, comma_list, positive_int, save_report, start_run

VOCAB = 49_152


def median_ms(call: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` timed calls (after one untimed), in milliseconds."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def model_logits(count: int) -> torch.Tensor:
    """The packaged SmolLM2's logits at ``count`` positions of real code (this module's own source),
    one forward: the shapes of distributions a verification samples from."""
    from transformers import AutoModelForCausalLM

    from rest_spec.common.checkpoint import hf_checkpoint
    from rest_spec.common.tokenizer import load_tokenizer

    checkpoint = str(hf_checkpoint(None, dtype="float32"))
    ids = load_tokenizer(None).encode(Path(__file__).read_text(encoding="utf-8"))[: count + 1]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, 1 : count + 1].float()


def measure(rows: int, positions: int, logits: torch.Tensor, args: argparse.Namespace) -> dict:
    """Each function's median milliseconds for one verification of ``rows`` x ``positions``
    (the first of ``logits``' positions)."""
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p as vllm_top_k_top_p

    from rest_spec.drafter.vllm import sampling

    generator = torch.Generator().manual_seed(rows * 100 + positions)
    count = rows * positions
    logits = logits[:count] / args.temperature
    top_p = torch.full((count,), args.top_p)
    top_k = None if args.top_k is None else torch.full((count,), args.top_k)
    probs = sampling.apply_top_k_top_p(logits.clone(), top_k, top_p).softmax(dim=-1)
    draft = torch.randint(0, VOCAB, (count,), generator=generator, dtype=torch.int32)
    ends = torch.arange(positions, count + 1, positions, dtype=torch.int32)
    vllm_recovered = rejection_sampler.sample_recovered_tokens
    ours_recovered = sampling.recovered_tokens_sampler(vllm_recovered)

    def recover(sample) -> torch.Tensor:
        seeded = types.SimpleNamespace(generators={row: torch.Generator().manual_seed(row) for row in range(rows)})
        return sample(positions, [positions] * rows, ends, draft, None, probs, seeded, "cpu")

    result = {
        "rows": rows,
        "positions_a_row": positions,
        "vllm_top_k_top_p_ms": median_ms(lambda: vllm_top_k_top_p(logits.clone(), top_k, top_p), args.repeats),
        "ours_top_k_top_p_ms": median_ms(
            lambda: sampling.apply_top_k_top_p(logits.clone(), top_k, top_p), args.repeats
        ),
        "vllm_recovered_ms": median_ms(lambda: recover(vllm_recovered), args.repeats),
        "ours_recovered_ms": median_ms(lambda: recover(ours_recovered), args.repeats),
    }
    result["vllm_ms"] = result["vllm_top_k_top_p_ms"] + result["vllm_recovered_ms"]
    result["ours_ms"] = result["ours_top_k_top_p_ms"] + result["ours_recovered_ms"]
    result["saved_ms_a_position"] = (result["vllm_ms"] - result["ours_ms"]) / count
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rows", type=comma_list(item=positive_int), default="1,8", help="sampled requests (default: %(default)s)"
    )
    p.add_argument(
        "--positions",
        type=comma_list(item=positive_int),
        default="1,3",
        help="drafted positions a request (default: %(default)s)",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95, help="(default: %(default)s)")
    p.add_argument("--top-k", type=positive_int, default=None, help="(default: none)")
    p.add_argument(
        "--repeats", type=positive_int, default=30, help="timed calls of each function (default: %(default)s)"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "sampled" / "verify_sampling.json")
    args = p.parse_args(argv)
    report = start_run("verify_sampling", argv)
    # vLLM's CPU kernels (the recovered tokens') registered, as an engine's start registers them
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
    report["threads"] = torch.get_num_threads()
    logits = model_logits(max(args.rows) * max(args.positions))
    report["results"] = [measure(rows, positions, logits, args) for rows in args.rows for positions in args.positions]
    save_report(report, args.out, echo=False)
    print(
        f"{'rows':>4} {'pos':>4}  {'vLLM top-p':>10} {'ours':>6}  {'vLLM recovered':>14} {'ours':>6}  {'saved a position':>16}"
    )
    for r in report["results"]:
        print(
            f"{r['rows']:>4} {r['positions_a_row']:>4}  {r['vllm_top_k_top_p_ms']:>8.2f}ms {r['ours_top_k_top_p_ms']:>4.2f}ms"
            f"  {r['vllm_recovered_ms']:>12.2f}ms {r['ours_recovered_ms']:>4.2f}ms  {r['saved_ms_a_position']:>14.2f}ms"
        )
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
