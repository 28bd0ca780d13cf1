"""The decoding loop is lossless: ``generate`` equals ``model.generate(do_sample=False)`` token for
token, with no drafter, with real trees whose right branch is cut at varying depths among wrong
branches, with always-empty trees, with several eos ids, with logits processors that read the
context (repetition penalty, no-repeat n-grams, minimum length), with stopping criteria that fire in
the middle of a step; the streamer gets exactly the committed tokens; on tiny models of three
families, and (slow) on the real SmolLM2. Plus the CLI's argument and prompt-file errors.
Batches: ``test_batch.py``; sampling: ``test_sampling.py``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import MaxLengthCriteria

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.drafter.cli.rest_generate import main
from rest_spec.drafter.core.protocol import Drafter
from rest_spec.drafter.hf.generate import GenerationResult, eos_ids, generate
from rest_spec.drafter.hf.sampling import prepare_generation_config
from tests.helpers import (
    FAMILIES,
    OracleTreeDrafter,
    RecordingStreamer,
    StopAfterToken,
    chunks,
    reference_tokens,
    tiny_causal_lm,
)

NEW_TOKENS = 24
PROMPTS = {"one-token": [17], "short": [5, 17, 33, 99, 100, 7], "long": list(range(40, 340, 11))}


class EmptyDrafter(OracleTreeDrafter):
    """Never finds a match."""

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        return DraftTree.empty()


def check_stats(result: GenerationResult, max_new_tokens: int) -> None:
    assert result.steps == len(result.accepted_per_step) >= 1
    # each step commits its accepted tokens and one bonus token; only the last step is truncated
    assert sum(a + 1 for a in result.accepted_per_step[:-1]) < len(result.output_ids) <= max_new_tokens
    assert result.mean_accepted == pytest.approx(len(result.output_ids) / result.steps)
    assert 0 <= result.draft_seconds + result.verify_seconds + result.prefill_seconds <= result.seconds


MODELS = [*sorted(FAMILIES), "llama-eager"]


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    family, _, attn = request.param.partition("-")
    return tiny_causal_lm(family, attn or "sdpa")


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_lossless_without_drafter(model: PreTrainedModel, prompt: str) -> None:
    result = generate(model, PROMPTS[prompt], None, max_new_tokens=NEW_TOKENS)
    assert result.output_ids == reference_tokens(model, PROMPTS[prompt], NEW_TOKENS)
    assert result.steps == NEW_TOKENS and set(result.accepted_per_step) == {0}


@pytest.mark.parametrize("config", [DraftConfig(), DraftConfig(budget=6, max_depth=4)], ids=["c64", "c6"])
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_lossless_with_tree_drafter(model: PreTrainedModel, prompt: str, config: DraftConfig) -> None:
    ids = PROMPTS[prompt]
    expected = reference_tokens(model, ids, NEW_TOKENS)
    drafter = OracleTreeDrafter(ids + expected)
    assert isinstance(drafter, Drafter)
    result = generate(model, torch.tensor([ids]), drafter, max_new_tokens=NEW_TOKENS, config=config)
    assert result.output_ids == expected
    assert result.steps == drafter.contexts < NEW_TOKENS
    assert len(set(result.accepted_per_step)) > 1, "acceptance lengths should vary"
    assert max(result.accepted_per_step) <= config.max_depth
    check_stats(result, NEW_TOKENS)


def test_lossless_with_empty_trees(model: PreTrainedModel) -> None:
    ids = PROMPTS["short"]
    result = generate(model, ids, EmptyDrafter([]), max_new_tokens=NEW_TOKENS)
    assert result.output_ids == reference_tokens(model, ids, NEW_TOKENS)
    assert result.steps == NEW_TOKENS


@pytest.mark.parametrize("use_drafter", [False, True], ids=["plain", "tree"])
def test_stops_after_first_of_several_eos_ids(model: PreTrainedModel, use_drafter: bool) -> None:
    ids = PROMPTS["short"]
    free_run = reference_tokens(model, ids, NEW_TOKENS)
    stop = [free_run[12], free_run[7]]  # tokens the model will emit; the earlier one stops it
    expected = reference_tokens(model, ids, NEW_TOKENS, eos_token_id=stop)
    assert len(expected) < NEW_TOKENS and expected[-1] in stop
    drafter = OracleTreeDrafter(ids + free_run, seed=1) if use_drafter else None
    result = generate(model, ids, drafter, max_new_tokens=NEW_TOKENS, eos_token_id=stop)
    assert result.output_ids == expected


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2])
def test_tiny_budgets(model: PreTrainedModel, max_new_tokens: int) -> None:
    ids = PROMPTS["short"]
    expected = reference_tokens(model, ids, NEW_TOKENS)
    drafter = OracleTreeDrafter(ids + expected)
    result = generate(model, ids, drafter, max_new_tokens=max_new_tokens)
    assert result.output_ids == expected[:max_new_tokens]
    assert (result.steps == 0) == (max_new_tokens == 0) and result.steps <= max_new_tokens


# Processors that read the context, as model.generate builds them from these settings; with
# min_new_tokens, an eos id (an early greedy token) makes it matter.
GREEDY_SETTINGS = {
    "repetition-penalty": dict(repetition_penalty=1.6),
    "no-repeat-ngram": dict(no_repeat_ngram_size=2),
    "min-new-tokens": dict(min_new_tokens=12),
    "all-three": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=6),
}


@pytest.mark.parametrize("settings", sorted(GREEDY_SETTINGS))
def test_lossless_with_logits_processors(model: PreTrainedModel, settings: str) -> None:
    """Processors at a tree node must see the context plus the path to the node: a repeated draft
    token, an n-gram completed inside the tree or the length at a node all change the argmax."""
    ids = PROMPTS["one-token"]  # its greedy run repeats tokens and bigrams in every model family
    kwargs = GREEDY_SETTINGS[settings]
    eos = [reference_tokens(model, ids, NEW_TOKENS)[4]] if "min_new_tokens" in kwargs else None
    expected = reference_tokens(model, ids, NEW_TOKENS, eos_token_id=eos, **kwargs)
    assert expected != reference_tokens(model, ids, NEW_TOKENS, eos_token_id=eos), "the settings must matter"
    drafter = OracleTreeDrafter(ids + expected)
    result = generate(
        model, ids, drafter, max_new_tokens=NEW_TOKENS, eos_token_id=eos, generation_config=GenerationConfig(**kwargs)
    )
    assert result.output_ids == expected
    assert result.steps < len(expected)


@pytest.mark.parametrize("criterion", ["token", "length"], ids=["stop-after-token", "max-length"])
def test_stopping_criteria_cut_inside_a_step(model: PreTrainedModel, criterion: str) -> None:
    ids = PROMPTS["short"]
    free_run = reference_tokens(model, ids, NEW_TOKENS)
    stop = StopAfterToken(free_run[9]) if criterion == "token" else MaxLengthCriteria(len(ids) + 9)
    expected = reference_tokens(model, ids, NEW_TOKENS, stopping_criteria=StoppingCriteriaList([stop]))
    assert len(expected) < NEW_TOKENS
    drafter = OracleTreeDrafter(ids + free_run, seed=2)
    result = generate(model, ids, drafter, max_new_tokens=NEW_TOKENS, stopping_criteria=StoppingCriteriaList([stop]))
    assert result.output_ids == expected
    assert sum(a + 1 for a in result.accepted_per_step) > len(expected), "the last step must be cut"


def test_streamer_gets_each_steps_committed_tokens(model: PreTrainedModel) -> None:
    ids = PROMPTS["short"]
    free_run = reference_tokens(model, ids, NEW_TOKENS)
    streamer = RecordingStreamer()
    result = generate(
        model,
        ids,
        OracleTreeDrafter(ids + free_run),
        max_new_tokens=NEW_TOKENS,
        eos_token_id=free_run[-3],
        streamer=streamer,
    )
    assert streamer.ended
    assert [value.tolist() for value in streamer.values] == chunks(result)
    assert torch.cat(streamer.values).tolist() == result.output_ids


def test_eos_ids_come_from_the_generation_config(model: PreTrainedModel) -> None:
    assert eos_ids(prepare_generation_config(model, None, None)) == frozenset()
    assert eos_ids(prepare_generation_config(model, None, 5)) == frozenset({5})
    assert eos_ids(prepare_generation_config(model, GenerationConfig(eos_token_id=[5, 9]), None)) == frozenset({5, 9})
    assert eos_ids(prepare_generation_config(model, GenerationConfig(eos_token_id=[5, 9]), [7])) == frozenset({7})


@pytest.mark.parametrize(
    "input_ids, attention_mask, message",
    [
        ([], None, "at least one token"),
        (torch.zeros(0, dtype=torch.long), None, "at least one token"),
        (torch.zeros(0, 3, dtype=torch.long), None, "no prompts"),
        ([[1, 2], []], None, "prompt 1 has no tokens"),
        (torch.zeros(2, 2, 3, dtype=torch.long), None, r"\[L\] or \[B, L\]"),
        (torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 1], [1, 1, 0]]), "left padding"),
        (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4), "attention_mask has shape"),
        (torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 1], [0, 0, 0]]), "prompt 1 has no tokens"),
    ],
    ids=["empty", "empty-tensor", "no-rows", "empty-row", "3d", "right-padding", "mask-shape", "all-padding"],
)
def test_rejects_bad_prompts(model: PreTrainedModel, input_ids, attention_mask, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate(model, input_ids, None, max_new_tokens=4, attention_mask=attention_mask)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(num_beams=2), "greedy search and sampling only"),
        (dict(num_return_sequences=2), "num_return_sequences"),
        (dict(guidance_scale=1.5), "guidance_scale"),
        (dict(stop_strings=["x"]), "StopStringCriteria"),
    ],
    ids=["beams", "return-sequences", "guidance", "stop-strings"],
)
def test_rejects_unsupported_generation_configs(model: PreTrainedModel, settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate(model, [1, 2], None, max_new_tokens=4, generation_config=GenerationConfig(**settings))


# --- the real model (``smollm2``: the session fixture in conftest.py) ------------------------------


@pytest.mark.model
@pytest.mark.parametrize("text", ["def fibonacci(n):\n    ", "The three primary colors are"], ids=["code", "prose"])
def test_lossless_on_smollm2(smollm2, text: str) -> None:
    model, tokenizer = smollm2
    ids = tokenizer(text).input_ids
    expected = reference_tokens(model, ids, 32)
    result = generate(model, ids, OracleTreeDrafter(ids + expected), max_new_tokens=32)
    assert result.output_ids == expected
    assert result.steps < 32


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--datastore", "--prompts", "--no-draft", "--max-new-tokens", "--budget", "--json"):
        assert flag in help_text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no-draft", "--prompt", "hi", "--budget", "0"], "budget must be in [1, "),
        (["--no-draft", "--prompt", "hi", "--max-new-tokens", "0"], "must be >= 1"),
        (["--prompt", "hi"], "one of the arguments --datastore --no-draft is required"),
    ],
    ids=["config-refuses", "argparse-refuses", "missing"],
)
def test_cli_usage_errors_exit_2_with_the_usage_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Before anything is loaded, as every command's usage errors."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rest-generate") and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv", [["--no-draft"], ["--datastore", ".", "--engine", "llama.cpp"]], ids=["no-draft", "llama.cpp"]
)
def test_cli_compare_needs_drafts_and_the_transformers_engine(capsys: pytest.CaptureFixture[str], argv) -> None:
    """Before anything is loaded: --compare times drafting against decoding without drafts."""
    assert main([*argv, "--prompt", "hi", "--compare"]) == 1
    err = capsys.readouterr().err
    assert "--compare decodes with drafts from --datastore and without them" in err and "Traceback" not in err


def write_jsonl(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"text": "x"}), "expected"),
        (json.dumps({"messages": [{"role": "user"}]}), "expected"),
    ],
    ids=["syntax", "no-prompt-key", "bad-messages"],
)
def test_cli_bad_jsonl_line_exits_1_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad_line: str, message: str
) -> None:
    path = write_jsonl(tmp_path / "prompts.jsonl", [json.dumps({"prompt": "hello"}), "", bad_line])
    assert main(["--no-draft", "--prompts", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:3:" in err and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no-draft", "--prompts", "{tmp}/missing.jsonl"], "cannot read prompts file"),
        (["--datastore", "{tmp}/no-index", "--prompt", "hi"], "no such index directory"),
    ],
    ids=["missing-prompts", "missing-datastore"],
)
def test_cli_failures_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main([arg.format(tmp=tmp_path) for arg in argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
