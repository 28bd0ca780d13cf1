"""The decoding loop is lossless: ``generate`` equals ``model.generate(do_sample=False)`` token for
token, with no drafter, with real trees whose right branch is cut at varying depths among wrong
branches, with always-empty trees, and with several eos ids; on tiny models of three families, and
(slow) on the real SmolLM2. Plus the CLI's argument and prompt-file errors."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

import pytest
import torch
from transformers import PreTrainedModel

from datastore.types import DraftConfig, DraftTree, IndexInfo
from drafter.__main__ import main
from drafter.base import Drafter
from drafter.generate import GenerationResult, eos_ids, generate
from tests.helpers import FAMILIES, tiny_causal_lm, tree_from_paths
from tests.helpers import MODEL_VOCAB as VOCAB

NEW_TOKENS = 24
PROMPTS = {"one-token": [17], "short": [5, 17, 33, 99, 100, 7], "long": list(range(40, 340, 11))}


class OracleTreeDrafter:
    """A Drafter that knows the greedy continuation ``reference`` (prompt + output) and drafts real
    trees: the right branch cut at a random depth (0 .. max_depth), a wrong sibling at every level
    of it, a wrong token right below the cut, and a wrong child under each wrong node."""

    def __init__(self, reference: Sequence[int], seed: int = 0) -> None:
        self.reference = list(reference)
        self.seed = seed
        self.contexts = 0

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        assert list(context) == self.reference[: len(context)], "the loop must pass prompt + committed tokens"
        self.contexts += 1
        rng = random.Random(self.seed * 100_003 + len(context))
        future = self.reference[len(context) : len(context) + config.max_depth]
        right = future[: rng.randint(0, len(future))]
        paths = [right]
        for depth in range(min(len(right) + 1, config.max_depth)):
            true_next = future[depth] if depth < len(future) else None
            wrong = (true_next if true_next is not None else rng.randrange(VOCAB)) + rng.randrange(1, VOCAB)
            paths.append(right[:depth] + [wrong % VOCAB, rng.randrange(VOCAB)][: config.max_depth - depth])
        return tree_from_paths([p for p in paths if p], budget=config.budget)

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]:
        return [self.draft(context, config) for context in contexts]

    def info(self) -> IndexInfo:
        return IndexInfo(1, "oracle", "sha256:oracle", VOCAB, 0, 0, ())

    def close(self) -> None:
        pass


class EmptyDrafter(OracleTreeDrafter):
    """Never finds a match."""

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        return DraftTree.empty()


def reference_tokens(
    model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int, **kwargs
) -> list[int]:
    """New tokens of Hugging Face greedy decoding."""
    output = model.generate(
        torch.tensor([list(prompt)], device=model.device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        **kwargs,
    )
    return output[0, len(prompt) :].tolist()


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


def test_eos_ids_default_to_generation_config(model: PreTrainedModel) -> None:
    assert eos_ids(model, None) == frozenset()
    assert eos_ids(model, 5) == frozenset({5})
    assert eos_ids(model, [5, 9]) == frozenset({5, 9})


def test_rejects_bad_prompts(model: PreTrainedModel) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [], None, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"\[1, L\]"):
        generate(model, torch.zeros(2, 3, dtype=torch.long), None, max_new_tokens=4)


# --- the real model (``smollm2``: the session fixture in conftest.py) ------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "text", ["def fibonacci(n):\n    ", "The three primary colors are"], ids=["code", "prose"]
)
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
def test_cli_bad_jsonl_line_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad_line: str, message: str
) -> None:
    path = write_jsonl(tmp_path / "prompts.jsonl", [json.dumps({"prompt": "hello"}), "", bad_line])
    assert main(["--no-draft", "--prompts", str(path)]) == 2
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
def test_cli_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main([arg.format(tmp=tmp_path) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
