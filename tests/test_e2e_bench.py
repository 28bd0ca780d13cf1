"""benchmarks.e2e (and benchmarks.replay, benchmarks.tradeoff) on a tiny setting: every mode and drafter on real
parts (SmolLM2, the stdlib index, REST's draftretriever), outputs checked against plain decoding, the adaptive mode's
output store fed; the figures themselves are not checked (timings on a shared test machine mean nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import tradeoff
from benchmarks.common import chat_prompt, humaneval_inputs, humaneval_prompts
from benchmarks.e2e import MODES, SIDE_BY_SIDE, codebase_prompt, parse_args, run_set, set_prompts, targets
from benchmarks.replay import greedy_path, replay
from rest_spec.build_index.build import BuildConfig, build
from rest_spec.build_index.corpora import CorpusSpec, Record, Turn, held_out_records
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.hf.generate import generate
from tests.test_adaptive import CPU_COST

pytestmark = pytest.mark.bench


def test_arguments_are_checked_and_plain_always_runs():
    args = parse_args(["--modes", "adaptive,paper", "--sets", "sharegpt"])
    assert args.modes == ["plain", "paper", "adaptive"] and args.sets == ["sharegpt"]
    assert parse_args([]).sets == ["humaneval", "sharegpt"]
    assert parse_args(["--sets", "humaneval-chat"]).sets == ["humaneval-chat"]
    assert parse_args(["--out", "runs/paper.json"]).plot == Path("runs/paper.png")  # never over another run's plot
    for bad in (["--modes", "plain,fast"], ["--sets", "mtbench"], ["--prompts", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_humaneval_sets_are_the_raw_code_and_the_same_prompts_as_a_chat_turn():
    tokenizer = load_tokenizer(None)
    texts = humaneval_prompts(2)
    raw = set_prompts("humaneval", tokenizer, Path("indexes/python-stdlib"), 2, 1024)
    chat = set_prompts("humaneval-chat", tokenizer, Path("indexes/python-stdlib"), 2, 1024)
    assert raw == [tokenizer(text).input_ids for text in texts]
    assert chat == [chat_prompt(tokenizer, text) for text in texts]
    assert all(len(c) > len(r) for c, r in zip(chat, raw))  # the template wraps the code


def test_skip_prompts_starts_a_set_past_the_prompts_choices_were_tuned_on():
    tokenizer = load_tokenizer(None)
    index = Path("indexes/python-stdlib")
    assert set_prompts("humaneval", tokenizer, index, 3, 1024, skip=100) == humaneval_inputs(tokenizer, 103)[100:]
    assert len(set_prompts("humaneval", tokenizer, index, 64, 1024, skip=100)) == 64  # HumanEval 101-164
    with pytest.raises(SystemExit, match="HumanEval has 64 prompts after the first 100; 65 wanted"):
        set_prompts("humaneval", tokenizer, index, 65, 1024, skip=100)
    assert parse_args(["--skip-prompts", "40"]).skip_prompts == 40


def test_a_codebase_prompt_is_a_held_out_file_cut_after_a_def_line_in_its_second_half():
    tokenizer = load_tokenizer(None)
    head = "def first(x):\n    return x\n"  # a def in the first half: not the cut
    text = (
        head
        + "import os\n" * 10
        + "class Box:\n    async def open(self, path: str) -> None:\n        self.path = path\n"
    )
    ids = codebase_prompt(tokenizer, Record("box.py", (Turn("text", text),)), 1024)
    assert tokenizer.decode(ids) == text[: text.index("None:\n") + len("None:\n")]
    assert codebase_prompt(tokenizer, Record("box.py", (Turn("text", text),)), 5) == ids[-5:]
    assert codebase_prompt(tokenizer, Record("flat.py", (Turn("text", head + "x = 1\n" * 10),)), 1024) == []


@pytest.mark.build
def test_the_codebase_set_comes_from_the_files_its_index_holds_out(tmp_path):
    tokenizer = load_tokenizer(None)
    index = tmp_path / "tqdm"
    build(BuildConfig(CorpusSpec("python-package:tqdm", skip_last=8), index, progress=False))
    held = {record.id: record for record in held_out_records(CorpusSpec("python-package:tqdm", skip_last=8))}
    prompts = set_prompts("codebase", tokenizer, index, 2, 256)
    expected = [ids for ids in (codebase_prompt(tokenizer, r, 256) for r in held.values()) if ids][:2]
    assert prompts == expected and all(0 < len(ids) <= 256 for ids in prompts)
    assert set_prompts("codebase", tokenizer, index, 1, 256, skip=1) == expected[1:]


@pytest.mark.model
def test_every_mode_runs_and_matches_plain_decoding(smollm2, stdlib_index, monkeypatch, tmp_path):
    monkeypatch.setenv("REST_CACHE_DIR", str(tmp_path))
    model, tokenizer = smollm2
    args = parse_args(["--prompts", "2", "--max-new-tokens", "8"])
    prompts = humaneval_inputs(tokenizer, 2)
    with LocalDrafter.open(stdlib_index) as base:
        result = run_set("humaneval", prompts, base, model, CPU_COST, args)
        assert len(base.outputs) == 2  # the adaptive mode's outputs went into the store, one per prompt
    assert set(result["modes"]) == set(MODES) and result["prompts"] == 2
    for mode, summary in result["modes"].items():
        assert summary["same_as_plain"] == 2, mode
        assert len(result["per_prompt"][mode]) == 2
        assert summary["mean_accepted"] >= 1 and summary["median_tokens_per_second"] > 0
    assert result["modes"]["plain"]["mean_verified_per_step"] == 1
    assert result["modes"]["plain-layout"]["mean_accepted"] == 1  # no drafts, at the cost's fastest block
    assert result["modes"]["hf"]["mean_verified_per_step"] == result["modes"]["hf"]["mean_accepted"] == 1
    # prompt lookup finds n-grams of the prompt's code again: its forwards verify candidates as well
    assert result["modes"]["pld"]["mean_verified_per_step"] > 1
    assert result["modes"]["paper"]["mean_verified_per_step"] > 1
    assert set(result["adaptive_mode_source_weights"]) == {"index", "request", "outputs"}
    # the oracle drafts plain's own next tokens: every one is accepted (a last step's bonus token
    # may fall past the 8 asked for)
    assert result["modes"]["oracle"]["mean_accepted"] > 1
    for row in result["per_prompt"]["oracle"]:
        assert round(row["steps"] * row["verified_per_step"]) - row["new_tokens"] in (0, 1), row
    for mode, baseline in SIDE_BY_SIDE:
        assert result[f"median_speed_{mode}_vs_{baseline}"] > 0
    # plain mode's outputs are the replay benchmarks' greedy reference, cached for them
    cached = json.loads(greedy_path(model, "humaneval", prompts, 8).read_text())
    assert cached == [[ids, generate(model, ids, None, max_new_tokens=8).output_ids] for ids in prompts]
    checks = targets({"sets": {"humaneval": result}})
    assert checks["every output equals plain decoding"] is True
    assert {"humaneval: adaptive median speed >= 1.8x plain", "humaneval: adaptive median speed >= 1.3x pld"} <= set(
        checks
    )


@pytest.mark.model
def test_tradeoff_replay_accepts_what_the_real_loop_accepts(smollm2, stdlib_index):
    """The offline replay (no model) gives exactly the steps of the real decoding loop, for the
    paper drafter and for the adaptive one with its state (calibration, output store)."""
    model, tokenizer = smollm2
    prompts = humaneval_inputs(tokenizer, 2)
    examples = [(ids, generate(model, ids, None, max_new_tokens=24).output_ids) for ids in prompts]
    config = DraftConfig(budget=16)
    for adaptive in (False, True):
        with LocalDrafter.open(stdlib_index) as real_base, LocalDrafter.open(stdlib_index) as replay_base:
            make = (
                (lambda base: AdaptiveDrafter(base, cost=CPU_COST, config=config)) if adaptive else (lambda base: base)
            )
            real_drafter, replay_drafter = make(real_base), make(replay_base)
            tokens = steps = 0
            for ids, output in examples:
                # the replay drafts each step from the committed context, as the loop does without overlap,
                # priced by a fixed table: the loop gets the table itself, so that no step time it observes
                # corrects the drafter's cost (CorrectedCost) away from what the replay prices
                result = generate(
                    model, ids, real_drafter, max_new_tokens=24, config=config, overlap=False, cost=CPU_COST
                )
                assert result.output_ids == output
                tokens, steps = tokens + len(output), steps + result.steps
                if adaptive:
                    real_drafter.add_output(output)
            remember = replay_drafter.add_output if adaptive else None
            replayed = replay(examples, replay_drafter, config, CPU_COST, remember)
        assert replayed["mean_accepted"] == pytest.approx(tokens / steps), adaptive
        assert replayed["verified_per_step"] > 1 and replayed["modeled_speed_vs_plain"] > 0


@pytest.mark.model
def test_tradeoff_replays_rest_engine_beside_paper_and_adaptive(smollm2, stdlib_index):
    """REST's own engine (draftretriever over the index's documents) is replayed like every drafter, and the
    accepted lengths relative to it feed the tradeoff target."""
    model, tokenizer = smollm2
    ids = humaneval_inputs(tokenizer, 1)[0]
    examples = [(ids, generate(model, ids, None, max_new_tokens=16).output_ids)]
    args = tradeoff.parse_args(["--prompts", "1", "--sizes", "64"])
    results = tradeoff.run_set(examples, stdlib_index, CPU_COST, args)
    assert set(results) == {"rest", "paper", "adaptive", "adaptive@64"}
    assert results["rest"]["accepted_vs_rest"] == results["paper"]["accepted_vs_paper"] == 1
    assert results["rest"]["verified_per_step"] > 1 and results["rest"]["mean_accepted"] >= 1
    for row in results.values():
        assert row["accepted_vs_rest"] == pytest.approx(row["mean_accepted"] / results["rest"]["mean_accepted"])
    checks = tradeoff.targets({"sets": {"humaneval": results}}, args.budget)
    assert list(checks) == ["humaneval: adaptive@64 accepted length >= 1.3x rest"]
    assert tradeoff.targets({"sets": {"humaneval": results}}, 32) == {}  # adaptive@32 was not replayed
