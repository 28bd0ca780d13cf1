"""benchmarks.e2e on a tiny setting: every mode on real parts (SmolLM2, the stdlib index), outputs
checked against plain decoding, the new mode's output store fed; the figures themselves are not
checked (timings on a shared test machine mean nothing)."""

from __future__ import annotations

import pytest

from benchmarks.data import humaneval_inputs
from benchmarks.e2e import MODES, parse_args, run_set, targets
from drafter.local import LocalDrafter
from tests.test_adaptive import CPU_COST


def test_arguments_are_checked_and_plain_always_runs():
    args = parse_args(["--modes", "new,paper", "--sets", "sharegpt"])
    assert args.modes == ["plain", "paper", "new"] and args.sets == ["sharegpt"]
    for bad in (["--modes", "plain,fast"], ["--sets", "mtbench"], ["--prompts", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.slow
def test_every_mode_runs_and_matches_plain_decoding(smollm2, stdlib_index):
    model, tokenizer = smollm2
    args = parse_args(["--prompts", "2", "--max-new-tokens", "8"])
    prompts = humaneval_inputs(tokenizer, 2)
    with LocalDrafter.open(stdlib_index) as base:
        result = run_set("humaneval", prompts, base, model, CPU_COST, args)
        assert len(base.outputs) == 2  # the new mode's outputs went into the store, one per prompt
    assert set(result["modes"]) == set(MODES) and result["prompts"] == 2
    for mode, summary in result["modes"].items():
        assert summary["same_as_plain"] == 2, mode
        assert len(result["per_prompt"][mode]) == 2
        assert summary["mean_accepted"] >= 1 and summary["median_tokens_per_second"] > 0
    assert result["modes"]["plain"]["mean_verified_per_step"] == 1
    assert result["modes"]["paper"]["mean_verified_per_step"] > 1
    assert set(result["new_mode_source_weights"]) == {"index", "request", "outputs"}
    checks = targets({"sets": {"humaneval": result}})
    assert checks["every output equals plain decoding"] is True
    assert "humaneval: new median speed >= 1.2x plain" in checks
