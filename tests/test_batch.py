"""Batches: every row of a ``generate`` call on B prompts of different lengths is decoded exactly as
that prompt alone by ``model.generate`` (greedy), whether the prompts come as lists or left-padded
with an attention mask, with or without draft trees; eos in one row and stopping criteria end that
row only; finished rows are no longer drafted; the streamer receives exactly each step's committed
tokens. On tiny models, and (slow) on the real SmolLM2 with its tokenizer's padding and a stop
string. Sampling in batches: ``test_sampling.py``."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.drafter.hf.generate import BatchGenerationResult, generate
from tests.helpers import OracleTreeDrafter, RecordingStreamer, StopAfterToken, chunks, reference_tokens, tiny_causal_lm

NEW_TOKENS = 20
PROMPTS = [[17], [5, 17, 33, 99, 100, 7], list(range(40, 340, 11)), [300, 2, 300]]
PAD = 0  # the id written into left padding; masked, so any id works


class CountingDrafter(OracleTreeDrafter):
    """An ``OracleTreeDrafter`` that records every context it was asked for."""

    def __init__(self, *references: Sequence[int], seed: int = 0) -> None:
        super().__init__(*references, seed=seed)
        self.asked: list[list[int]] = []

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        self.asked.append(list(context))
        return super().draft(context, config)


def left_padded(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, L] as a tokenizer with ``padding_side="left"`` makes them."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def references(model: PreTrainedModel, prompts: Sequence[Sequence[int]], **kwargs) -> list[list[int]]:
    """Each prompt decoded alone by ``model.generate`` (greedy)."""
    return [reference_tokens(model, prompt, NEW_TOKENS, **kwargs) for prompt in prompts]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return tiny_causal_lm(request.param)


@pytest.fixture(scope="module")
def expected(model: PreTrainedModel) -> list[list[int]]:
    return references(model, PROMPTS)


@pytest.mark.parametrize("form", ["lists", "left-padded"])
@pytest.mark.parametrize("with_drafter", [False, True], ids=["plain", "trees"])
def test_each_row_equals_that_prompt_alone(model, expected, form: str, with_drafter: bool) -> None:
    drafter = CountingDrafter(*(p + e for p, e in zip(PROMPTS, expected))) if with_drafter else None
    if form == "lists":
        result = generate(model, PROMPTS, drafter, max_new_tokens=NEW_TOKENS, config=DraftConfig(budget=12))
    else:
        ids, mask = left_padded(PROMPTS)
        result = generate(
            model, ids, drafter, max_new_tokens=NEW_TOKENS, attention_mask=mask, config=DraftConfig(budget=12)
        )
    assert isinstance(result, BatchGenerationResult)
    assert result.output_ids == expected
    row_steps = [len(steps) for steps in result.accepted_per_step]
    assert result.steps == max(row_steps)
    if with_drafter:
        assert len(drafter.asked) == sum(row_steps)  # one tree per row and step
        assert max(row_steps) < NEW_TOKENS and len(set(row_steps)) > 1, "rows should accept differently"
        assert result.mean_accepted == pytest.approx(len(PROMPTS) * NEW_TOKENS / sum(row_steps))
    else:
        assert row_steps == [NEW_TOKENS] * len(PROMPTS)


def test_eos_in_one_row_ends_that_row_only(model, expected) -> None:
    """The eos id is a token only row 1 emits; once it has, row 1 is neither drafted nor grown."""
    eos = next(t for t in expected[1][3:] if all(t not in e for i, e in enumerate(expected) if i != 1))
    stopped = references(model, PROMPTS, eos_token_id=eos)
    assert len(stopped[1]) < NEW_TOKENS and [len(s) for i, s in enumerate(stopped) if i != 1] == [NEW_TOKENS] * 3
    drafter = CountingDrafter(*(p + e for p, e in zip(PROMPTS, expected)), seed=3)
    result = generate(model, PROMPTS, drafter, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    assert result.output_ids == stopped
    assert sum(context[: len(PROMPTS[1])] == PROMPTS[1] for context in drafter.asked) == len(
        result.accepted_per_step[1]
    )


def test_stopping_criteria_end_rows_where_generate_would(model, expected) -> None:
    stop = StoppingCriteriaList([StopAfterToken(expected[2][6]), StopAfterToken(expected[0][11])])
    stopped = references(model, PROMPTS, stopping_criteria=stop)
    assert any(len(s) < NEW_TOKENS for s in stopped)
    drafter = OracleTreeDrafter(*(p + e for p, e in zip(PROMPTS, expected)), seed=4)
    result = generate(model, PROMPTS, drafter, max_new_tokens=NEW_TOKENS, stopping_criteria=stop)
    assert result.output_ids == stopped


def test_streamer_gets_each_rows_committed_tokens(model, expected) -> None:
    """Each put is [B, k] for one step; a row's part, its padding stripped, is what it committed."""
    pad = next(t for t in range(512) if all(t not in e for e in expected))
    streamer = RecordingStreamer()
    drafter = OracleTreeDrafter(*(p + e for p, e in zip(PROMPTS, expected)))
    eos = expected[3][8]
    result = generate(
        model,
        PROMPTS,
        drafter,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=eos,
        streamer=streamer,
        generation_config=GenerationConfig(pad_token_id=pad),
    )
    assert streamer.ended and len(streamer.values) == result.steps
    assert all(value.shape[0] == len(PROMPTS) for value in streamer.values)
    for row in range(len(PROMPTS)):
        puts = [[t for t in value[row].tolist() if t != pad] for value in streamer.values]
        assert puts[: len(result.accepted_per_step[row])] == chunks(result.row(row))
        assert not any(puts[len(result.accepted_per_step[row]) :]), "finished rows get padding only"


def test_streaming_a_batch_needs_a_pad_id(model) -> None:
    with pytest.raises(ValueError, match="pad_token_id"):
        generate(model, PROMPTS, None, max_new_tokens=2, streamer=RecordingStreamer())


def test_no_new_tokens(model) -> None:
    result = generate(model, PROMPTS, None, max_new_tokens=0)
    assert result.output_ids == [[]] * len(PROMPTS) and result.steps == 0


# --- the real model -----------------------------------------------------------------------------


@pytest.mark.model
def test_smollm2_batch_with_tokenizer_padding_and_a_stop_string(smollm2) -> None:
    model, tokenizer = smollm2
    texts = ["def fibonacci(n):\n    ", "The three primary colors are", "import os\nimport sys\n\n\ndef main():"]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    prompts = [tokenizer(text).input_ids for text in texts]
    alone = [reference_tokens(model, p, 24) for p in prompts]
    drafter = OracleTreeDrafter(*(p + a for p, a in zip(prompts, alone)))
    result = generate(model, encoded.input_ids, drafter, max_new_tokens=24, attention_mask=encoded.attention_mask)
    assert result.output_ids == alone
    assert result.mean_accepted > 1.5

    stop_string = tokenizer.decode(alone[1])[12:16]  # inside row 1's reply
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop_string])])
    stopped = [reference_tokens(model, p, 24, stop_strings=[stop_string], tokenizer=tokenizer) for p in prompts]
    assert len(stopped[1]) < 24
    result = generate(
        model,
        encoded.input_ids,
        drafter,
        max_new_tokens=24,
        attention_mask=encoded.attention_mask,
        stopping_criteria=criteria,
    )
    assert result.output_ids == stopped
