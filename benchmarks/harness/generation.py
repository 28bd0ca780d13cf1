"""One prompt decoded by the transformers model, as the benchmarks of the transformers loop time it:
``model.generate`` (``hf_run``, greedy or sampled, with prompt lookup or without), a mode's run on a
prompt (``Run``), the ``GenerationConfig`` every mode decodes with (``generation_config``), and the
loop's ``generate`` results as a mode's figures on a prompt (``record``) and over the prompts
(``summarize``)."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from benchmarks.harness.report import GREEDY, Decoding
from rest_spec.drafter.cli.generation import sampling_config
from rest_spec.drafter.hf.generate import GenerationResult


@dataclasses.dataclass(frozen=True)
class Run:
    """One mode on one prompt."""

    output_ids: list[int]
    seconds: float
    steps: int
    verified_tokens: int  # tokens fed to the verifier over all steps (tree nodes + 1 per step)
    draft_seconds: float

    def row(self, reference: Run, compared: bool = True) -> dict:
        """Its figures against plain decoding's ``reference`` run; ``same_as_plain`` None where the
        outputs are not ``compared`` (model.generate's, sampled)."""
        new = len(self.output_ids)
        return {
            "new_tokens": new,
            "steps": self.steps,
            "mean_accepted": new / self.steps,
            "verified_per_step": self.verified_tokens / self.steps,
            "tokens_per_second": new / self.seconds,
            "speed_vs_plain": (new / self.seconds) / (len(reference.output_ids) / reference.seconds),
            "draft_ms_per_step": 1e3 * self.draft_seconds / self.steps,
            "same_as_plain": self.output_ids == reference.output_ids if compared else None,
        }


def generation_config(model, decoding: Decoding):
    """The ``GenerationConfig`` every mode decodes with: None greedy (the model's own, greedy for
    the packaged SmolLM2), else the model's sampling at ``decoding``'s temperature and top-p, no top-k
    cut (``rest-generate``'s ``sampling_config``)."""
    if not decoding.sampled:
        return None
    return sampling_config(model, argparse.Namespace(temperature=decoding.temperature, top_p=decoding.top_p))


def hf_run(
    model,
    ids: list[int],
    max_new_tokens: int,
    prompt_lookup_num_tokens: int | None = None,
    decoding: Decoding = GREEDY,
    seed: int | None = None,
) -> Run:
    """``model.generate``, greedy or sampled (``decoding``; torch's generator seeded with ``seed``
    first: ``model.generate`` draws from it); with ``prompt_lookup_num_tokens``, transformers' prompt
    lookup decoding. Every forward of the model is one verification step: its steps and verified
    tokens are counted from the tokens each forward is fed (the first one also gets the prompt)."""
    sampling = {"generation_config": generation_config(model, decoding)} if decoding.sampled else {"do_sample": False}
    fed: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    input_ids = torch.tensor([ids], device=model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    try:
        if decoding.sampled:
            torch.manual_seed(seed)
        sync()
        start = time.perf_counter()
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            **sampling,
            max_new_tokens=max_new_tokens,
            prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        )
        sync()
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    new = output[0, len(ids) :].tolist()
    return Run(new, seconds, len(fed), sum(fed) - len(ids) + 1, 0.0)


def record(result: GenerationResult, reference: GenerationResult | None) -> dict:
    """One mode's figures on one prompt."""
    return {
        "identical": reference is None or result.output_ids == reference.output_ids,
        "tokens": len(result.output_ids),
        "seconds": result.seconds,
        "steps": result.steps,
        "mean_accepted": result.mean_accepted,
        "draft_ms_per_step": 1e3 * result.draft_seconds / max(result.steps, 1),
        "verify_ms_per_step": 1e3 * result.verify_seconds / max(result.steps, 1),
        "drafting": result.drafting.summary(),
    }


def summarize(rows: list[dict], plain: list[dict], local: list[dict] | None) -> dict:
    """A mode over the prompts: medians of per-prompt ratios, means of per-step figures."""
    speed = [p["seconds"] / r["seconds"] for r, p in zip(rows, plain)]
    out = {
        "speed_vs_plain": statistics.median(speed),
        "mean_accepted": sum(r["tokens"] for r in rows) / max(sum(r["steps"] for r in rows), 1),
        "draft_ms_per_step": statistics.mean(r["draft_ms_per_step"] for r in rows),
        "verify_ms_per_step": statistics.mean(r["verify_ms_per_step"] for r in rows),
        "identical": sum(r["identical"] for r in rows),
        "prompts": len(rows),
        "ready_share": statistics.mean(r["drafting"]["ready_share"] for r in rows),
        "predicted_share": statistics.mean(r["drafting"]["predicted_share"] for r in rows),
        "wait_ms_median": statistics.median(r["drafting"]["wait_ms_median"] for r in rows),
        "wait_ms_p99": statistics.median(r["drafting"]["wait_ms_p99"] for r in rows),
        "launch_ms_median": statistics.median(r["drafting"]["launch_ms_median"] for r in rows),
        "fallbacks": sum(r["drafting"]["fallbacks"] for r in rows),
        "cancelled": sum(r["drafting"]["cancelled"] for r in rows),
    }
    if local is not None:
        out["speed_vs_local"] = statistics.median(r_l["seconds"] / r["seconds"] for r, r_l in zip(rows, local))
    return out
