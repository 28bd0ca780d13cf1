"""benchmarks.e2e (and benchmarks.harness.replay, benchmarks.tradeoff) on a tiny setting: every mode and drafter on real
parts (SmolLM2, the stdlib index, REST's draftretriever), outputs checked against plain decoding, the adaptive mode's
output store fed; the figures themselves are not checked (timings on a shared test machine mean nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import tradeoff
from benchmarks.e2e import (
    MODES,
    SIDE_BY_SIDE,
    kept_gain_lines,
    kept_gains,
    loop_run,
    parse_args,
    run_decodings,
    run_set,
    targets,
)
from benchmarks.harness.generation import generation_config, hf_run
from benchmarks.harness.replay import greedy_path, replay
from benchmarks.harness.report import GREEDY, Decoding, kept_gain
from benchmarks.harness.sets import chat_prompt, codebase_prompt, humaneval_inputs, humaneval_prompts, set_prompts
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


def test_sampling_arguments_name_the_decodings_and_refuse_what_greedy_cannot_use(capsys):
    assert parse_args([]).decodings == [GREEDY]
    sampled = Decoding(temperature=0.7, top_p=0.95, seed=3)
    assert parse_args(["--temperature", "0.7", "--top-p", "0.95", "--seed", "3"]).decodings == [sampled]
    assert parse_args(["--temperature", "0.7"]).decodings == [Decoding(0.7, 1.0, 0)]  # top-p 1, seed 0
    beside = parse_args(["--temperature", "0.7", "--top-p", "0.95", "--seed", "3", "--beside-greedy"])
    assert beside.decodings == [GREEDY, sampled] and [d.name for d in beside.decodings] == ["greedy", "sampled"]
    assert sampled.seed_of(0) == 3 and sampled.seed_of(5) == 8  # a seed per prompt: seed + its index
    for bad, says in (
        (["--top-p", "0.9"], "--top-p applies to sampling"),
        (["--seed", "1"], "--seed applies to sampling"),
        (["--beside-greedy"], "--beside-greedy sets sampled figures beside greedy ones"),
        (["--temperature", "-1"], "--temperature: must be a finite number >= 0"),
        (["--temperature", "0.7", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    ):
        with pytest.raises(SystemExit) as exit:
            parse_args(bad)
        assert exit.value.code == 2 and says in capsys.readouterr().err, bad


def test_kept_gain_is_the_share_of_the_greedy_gain_that_sampling_keeps():
    assert kept_gain(1.57, 1.28) == pytest.approx(0.28 / 0.57)  # the transformers figures on code
    assert kept_gain(2.0, 2.0) == 1 and kept_gain(2.0, 1.0) == 0 and kept_gain(2.0, 0.9) == pytest.approx(-0.1)
    assert kept_gain(1.0, 1.2) is None and kept_gain(0.8, 0.7) is None  # no greedy gain to keep
    assert kept_gain(None, 1.2) is None and kept_gain(1.5, None) is None

    def result(speeds: dict, side: dict) -> dict:
        modes = {mode: {"median_speed_vs_plain": speed} for mode, speed in speeds.items()}
        return {"modes": modes, **{f"median_speed_{pair}": speed for pair, speed in side.items()}}

    greedy = result({"plain": 1.0, "hf": 1.1, "adaptive": 2.0, "pld": 0.9}, {"adaptive_vs_hf": 1.8})
    sampled = result({"plain": 1.0, "hf": 1.05, "adaptive": 1.5, "pld": 0.7}, {"adaptive_vs_hf": 1.4})
    gains = kept_gains(greedy, sampled)
    assert set(gains) == {"hf_vs_plain", "adaptive_vs_plain", "pld_vs_plain", "adaptive_vs_hf"}
    assert gains["adaptive_vs_plain"] == {"greedy_speedup": 2.0, "sampled_speedup": 1.5, "kept": 0.5}
    assert gains["adaptive_vs_hf"]["kept"] == pytest.approx(0.5) and gains["pld_vs_plain"]["kept"] is None
    report = {"sets": {}, "kept_gain": {"humaneval": gains}}
    assert targets(report) == {
        "humaneval: sampled, adaptive keeps >= 0.75 of its greedy gain over plain": False,
        "every output equals plain decoding": None,  # nothing greedy ran: nothing compared
    }
    table = kept_gain_lines({"humaneval": gains}).splitlines()
    assert table[0].split() == ["set", "speed-up", "of", "greedy", "sampled", "kept"]
    assert "humaneval adaptive_vs_plain 2.00 1.50 0.50" in [" ".join(line.split()) for line in table]


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
def test_sampled_beside_greedy_every_mode_samples_with_a_seed_per_prompt(smollm2, stdlib_index, monkeypatch, tmp_path):
    """2 prompts, 8 new tokens, temperature 0.7 beside greedy: every mode runs both ways, the greedy
    ones equal plain's, the loop's sampled ones are counted against plain's (one seed draws one text
    there, drafts or not, but for float rounding at the edge of a draw), model.generate's sampled ones
    (hf, pld) are not compared; prompt i draws with seed + i, so a sampled run is reproduced by
    ``generate`` (the loop) or ``model.generate`` (hf) given that seed."""
    monkeypatch.setenv("REST_CACHE_DIR", str(tmp_path))
    model, tokenizer = smollm2
    args = parse_args(["--prompts", "2", "--max-new-tokens", "8", "--temperature", "0.7", "--seed", "5"])
    args.modes = ["plain", "hf", "pld", "adaptive", "oracle"]  # the loop's other modes decode as plain's do
    args.beside_greedy, sampled = True, args.decodings[0]
    prompts = humaneval_inputs(tokenizer, 2)
    with LocalDrafter.open(stdlib_index) as greedy_base, LocalDrafter.open(stdlib_index) as sampled_base:
        results = run_decodings(
            "humaneval", prompts, [greedy_base, sampled_base], model, CPU_COST, args, [GREEDY, sampled]
        )
        # each decoding's adaptive mode fills its own store: the sampled runs draft no greedy output of their prompt
        assert len(greedy_base.outputs) == len(sampled_base.outputs) == 2
    greedy, drawn = results["greedy"], results["sampled"]
    assert set(greedy["modes"]) == set(drawn["modes"]) == set(args.modes)
    for mode in args.modes:
        assert greedy["modes"][mode]["same_as_plain"] == 2, mode
        same = drawn["modes"][mode]["same_as_plain"]  # model.generate draws otherwise: not compared
        assert same is None if mode in ("hf", "pld") else same in (0, 1, 2), mode
        rows = [row["same_as_plain"] for row in drawn["per_prompt"][mode]]
        assert all(r is None if mode in ("hf", "pld") else isinstance(r, bool) for r in rows), (mode, rows)
        assert drawn["modes"][mode]["median_tokens_per_second"] > 0 and drawn["modes"][mode]["mean_accepted"] >= 1
    assert drawn["decoding"]["decoding"] == "sampled" and drawn["decoding"]["temperature"] == 0.7
    assert drawn["modes"]["pld"]["mean_verified_per_step"] > 1  # prompt lookup still drafts while sampling
    config = generation_config(model, sampled)
    assert config.do_sample and config.temperature == 0.7 and config.top_p == 1.0 and config.top_k == 0
    for i, ids in enumerate(prompts):  # the loop's modes: generate's generator, seeded with seed + i
        seeded = torch.Generator().manual_seed(5 + i)
        again = generate(model, ids, None, max_new_tokens=8, generation_config=config, generator=seeded)
        assert loop_run(model, ids, None, 8, DraftConfig(), decoding=sampled, seed=sampled.seed_of(i)).output_ids == (
            again.output_ids
        )
    hf = [hf_run(model, ids, 8, decoding=sampled, seed=5) for ids in (prompts[0], prompts[0])]
    assert hf[0].output_ids == hf[1].output_ids  # model.generate reproduced by its seed
    gains = kept_gains(greedy, drawn)
    assert {"adaptive_vs_plain", "adaptive_vs_hf", "oracle_vs_plain"} <= set(gains)
    assert all(
        g["kept"] is None or g["kept"] == kept_gain(g["greedy_speedup"], g["sampled_speedup"]) for g in gains.values()
    )
    checks = targets(
        {"sets": {"humaneval": greedy}, "sampled_sets": {"humaneval": drawn}, "kept_gain": {"humaneval": gains}}
    )
    assert checks["every output equals plain decoding"] is True
    assert "humaneval: adaptive median speed >= 1.8x plain" in checks  # the greedy targets, on the greedy figures
    # sampled, the oracle drafts the very text the run commits: it accepts at least what the adaptive drafter does
    assert drawn["modes"]["oracle"]["mean_accepted"] >= drawn["modes"]["adaptive"]["mean_accepted"]
    drawn["modes"]["adaptive"]["same_as_plain"] = 0  # sampled outputs parted by rounding are counted, not checked
    assert targets({"sets": {}, "sampled_sets": {"humaneval": drawn}})["every output equals plain decoding"] is None


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
