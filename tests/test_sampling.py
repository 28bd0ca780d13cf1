"""Sampling through draft trees is lossless: it has exactly ``model.generate(do_sample=True)``'s
distribution.

- ``TokenChooser.scores`` at every tree position of a padded batch equals ``model.generate``'s
  processors applied to plain decoding of the context plus the path to that position, for a list
  of score-only warpers and for one whose processors read the context.
- Statistical: the joint distribution of the first three sampled tokens of two prompts (in one
  left-padded batch, thousands of rows), drafted with realistic trees (the likeliest paths, several
  branches, a junk branch), against the exact probabilities of the tiny model; those probabilities
  are checked against ``model.generate``'s own processed scores. REST's rule (accept a draft token
  whenever it lies inside the top-k / top-p set) fails the same test, so the test has power.
- A fixed generator seed gives the same output with and without drafts.
- ``SortFreeTopP`` keeps the nucleus ``TopPLogitsWarper`` keeps (a property over sharp and flat rows).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.drafter.hf.generate import StopConditions, decode, generate, prefill
from rest_spec.drafter.hf.kv_cache import new_cache
from rest_spec.drafter.hf.sampling import SortFreeTopP, TokenChooser, prepare_generation_config, row_logits_processors
from rest_spec.drafter.hf.tree_attention import TreeInputs, build_tree_inputs
from rest_spec.drafter.hf.verify import tree_logits
from tests.helpers import ScriptedDrafter, chi_square, chi_square_critical, tiny_causal_lm, tree_from_paths
from tests.tiers import examples

PROMPTS = ([17], [5, 17, 33, 99, 100, 7])
NEW_TOKENS = 3
# A low temperature makes the tiny random model's near-uniform logits peaked; the repetition penalty
# then moves a lot of probability, so processors that ignored the draft path would be caught.
SAMPLING = dict(do_sample=True, temperature=0.05, top_k=4, top_p=0.9, repetition_penalty=1.5)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_causal_lm("llama")


# --- processed scores at every tree position ----------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
        dict(
            do_sample=True,
            temperature=0.7,
            top_k=20,
            repetition_penalty=1.5,
            no_repeat_ngram_size=2,
            min_new_tokens=3,
            eos_token_id=[3, 5],
        ),
    ],
    ids=["score-only", "context-reading"],
)
@torch.inference_mode()
def test_scores_at_every_tree_position_equal_plain_processing(model: PreTrainedModel, settings: dict) -> None:
    config = prepare_generation_config(model, GenerationConfig(**settings), None)
    # Trees that repeat context tokens and each other, so penalties and n-gram bans hit inside them.
    trees = [tree_from_paths([[17, 17, 5], [17, 40, 17, 40], [3, 5, 17]]), tree_from_paths([[7, 100, 7], [33]])]
    chooser = TokenChooser.for_prompts(model, config, [len(p) for p in PROMPTS], max_new_tokens=10)
    cache = new_cache(model)
    rows = prefill(model, cache, PROMPTS)
    inputs = build_tree_inputs([p[-1] for p in PROMPTS], trees, rows, model.device)
    scores = chooser.scores(tree_logits(model, cache, inputs), inputs, PROMPTS)

    for b, (prompt, tree) in enumerate(zip(PROMPTS, trees)):
        processors = row_logits_processors(model, config, len(prompt), 10, None)
        for position, path in enumerate([(), *tree.paths()]):
            ids = torch.tensor([prompt + list(path)])
            expected = processors(ids, model(input_ids=ids).logits[:, -1].float())[0]
            assert torch.equal(scores[b, position].isinf(), expected.isinf()), (b, path)
            finite = expected.isfinite()
            assert torch.allclose(scores[b, position][finite], expected[finite], atol=1e-4), (b, path)


@settings(max_examples=examples(200), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.sampled_from([5, 63, 64, 65, 300, 5000]),
    spread=st.floats(0.05, 8.0),
    top_p=st.floats(0.05, 0.999),
    keep=st.integers(1, 3),
)
def test_the_sort_free_nucleus_is_transformers_nucleus(seed, vocab, spread, top_p, keep) -> None:
    """``SortFreeTopP`` keeps exactly the tokens ``TopPLogitsWarper`` keeps, and their scores, for
    sharp distributions (a few tokens hold top_p), flat ones (its k grows to the whole vocabulary)
    and rows cut by top-k before it; in float64, so that rounding moves no token across the edge."""
    scores = torch.randn(4, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * spread
    scores[0, : vocab // 2] = -math.inf
    ids = torch.zeros(4, 1, dtype=torch.long)
    expected = TopPLogitsWarper(top_p, min_tokens_to_keep=keep)(ids, scores.clone())
    got = SortFreeTopP(top_p, min_tokens_to_keep=keep)(ids, scores.clone())
    assert torch.equal(got.isfinite(), expected.isfinite())
    assert torch.equal(got[got.isfinite()], scores[got.isfinite()])


# --- the exact distribution of the first tokens ---------------------------------------------------


def exact_processors() -> LogitsProcessorList:
    """``SAMPLING`` as explicit processors, in the order ``model.generate`` applies them."""
    return LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(SAMPLING["repetition_penalty"]),
            TemperatureLogitsWarper(SAMPLING["temperature"]),
            TopKLogitsWarper(SAMPLING["top_k"]),
            TopPLogitsWarper(SAMPLING["top_p"]),
        ]
    )


@torch.inference_mode()
def next_token_probs(model: PreTrainedModel, context: Sequence[int]) -> torch.Tensor:
    """float [V]: the sampling distribution after ``context``, from a plain full forward."""
    ids = torch.tensor([list(context)])
    logits = model(input_ids=ids).logits[:, -1].float()
    return torch.softmax(exact_processors()(ids, logits), dim=-1)[0]


def exact_tables(model: PreTrainedModel, prompt: Sequence[int]) -> tuple[dict, dict]:
    """(distribution after every reachable context prompt + up to NEW_TOKENS - 1 tokens, keyed by
    the context tuple; exact probability of every reachable first-NEW_TOKENS tuple)."""
    tables: dict[tuple[int, ...], torch.Tensor] = {}
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NEW_TOKENS):
        grown = {}
        for prefix, p in joint.items():
            probs = tables[tuple(prompt) + prefix] = next_token_probs(model, list(prompt) + list(prefix))
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = p * float(probs[token])
        joint = grown
    return tables, joint


@pytest.fixture(scope="module")
def exact(model: PreTrainedModel) -> list[tuple[dict, dict]]:
    return [exact_tables(model, prompt) for prompt in PROMPTS]


def test_exact_probabilities_are_model_generates(model: PreTrainedModel, exact) -> None:
    """The oracle's distributions are the ones ``model.generate`` samples from (its returned
    processed scores), along sequences it sampled itself."""
    for prompt, (tables, _) in zip(PROMPTS, exact):
        for seed in range(3):
            torch.manual_seed(seed)
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                output_scores=True,
                return_dict_in_generate=True,
                **SAMPLING,
            )
            sampled = out.sequences[0, len(prompt) :].tolist()
            for j, scores in enumerate(out.scores):
                probs = tables[tuple(prompt + sampled[:j])]
                assert torch.allclose(torch.softmax(scores[0], dim=-1), probs, atol=1e-6)


class LikelyPathsDrafter(ScriptedDrafter):
    """What a good drafter proposes, from the exact distributions: under every node the ``width``
    likeliest tokens, down to the NEW_TOKENS-th new token, plus a junk child of the root (a token
    the model cannot sample there). Width 4 covers the whole top-k support: the wide trees a drafter
    offers sampled rows, whose outputs spread over several continuations."""

    name = "exact"

    def __init__(self, tables: dict[tuple[int, ...], torch.Tensor], width: int = 2) -> None:
        self.tables, self.width = tables, width

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        context = tuple(context)
        if context not in self.tables:
            return DraftTree.empty()
        paths: list[tuple[int, ...]] = []
        frontier: list[tuple[int, ...]] = [()]
        while frontier:
            path = frontier.pop()
            probs = self.tables.get(context + path)
            if probs is None:
                continue
            likely = [t for t in probs.topk(self.width).indices.tolist() if probs[t] > 0]
            paths += [path + (t,) for t in likely]
            frontier += [path + (t,) for t in likely]
        junk = int(self.tables[context].argmin())
        return tree_from_paths([*paths, (junk,)])


class RestMembershipRule(TokenChooser):
    """REST's top-p rule, which is NOT lossless: a draft token is accepted whenever it lies inside
    the processed support of its parent (non-zero probability); only where no child does is a token
    sampled."""

    def __call__(self, logits: torch.Tensor, inputs: TreeInputs, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        scores = self.scores(logits, inputs, contexts)
        targets = self.pick(scores, inputs, contexts).numpy()
        allowed = scores.isfinite().numpy()  # [B, q, V]
        ids, parents, depths = (t.numpy() for t in (inputs.input_ids, inputs.parent_index, inputs.depths))
        for b, node in zip(*np.nonzero(depths > 0)):
            if allowed[b, parents[b, node], ids[b, node]]:
                targets[b, parents[b, node]] = ids[b, node]
        return torch.from_numpy(targets)


class PathBlindChooser(TokenChooser):
    """A plausible bug, NOT lossless: the processors at every tree position see the committed
    context only, not the draft path above the position (the repetition penalty misses it)."""

    def scores(self, logits: torch.Tensor, inputs: TreeInputs, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        scores = logits.float()
        for b, (processors, context) in enumerate(zip(self.processors, contexts)):
            scores[b] = processors(torch.tensor([list(context)]).expand(scores.shape[1], -1), scores[b])
        return scores


ROWS_PER_CALL = 400


def first_tokens(
    model: PreTrainedModel, exact, samples_per_prompt: int, rule: type[TokenChooser] | None = None, width: int = 2
) -> list[Counter]:
    """Counts of the first NEW_TOKENS tokens per prompt over ``samples_per_prompt`` rows each, the
    prompts alternating in left-padded batches, drafted by ``LikelyPathsDrafter`` of ``width``.
    ``rule`` None: ``generate`` itself; else ``decode`` with that chooser in place of ``TokenChooser``."""
    drafter = LikelyPathsDrafter({k: v for tables, _ in exact for k, v in tables.items()}, width)
    generator = torch.Generator().manual_seed(0)
    rows = [PROMPTS[i % len(PROMPTS)] for i in range(ROWS_PER_CALL)]
    config = prepare_generation_config(model, GenerationConfig(**SAMPLING), None)
    counts = [Counter() for _ in PROMPTS]
    for _ in range(math.ceil(samples_per_prompt * len(PROMPTS) / ROWS_PER_CALL)):
        if rule is None:
            result = generate(
                model,
                rows,
                drafter,
                max_new_tokens=NEW_TOKENS,
                generation_config=GenerationConfig(**SAMPLING),
                generator=generator,
            )
        else:
            chooser = rule.for_prompts(model, config, [len(r) for r in rows], NEW_TOKENS, generator=generator)
            result = decode(model, rows, drafter, chooser=chooser, stop=StopConditions(NEW_TOKENS))
        assert result.mean_accepted > 1.5, "the trees must be accepted often for the test to mean anything"
        for i, output in enumerate(result.output_ids):
            counts[i % len(PROMPTS)][tuple(output)] += 1
    return counts


@pytest.mark.parametrize("width", [2, 4], ids=["two-branches", "whole-support"])
def test_sampling_with_trees_has_the_exact_distribution(model: PreTrainedModel, exact, width: int) -> None:
    counts = first_tokens(model, exact, samples_per_prompt=2000, width=width)
    for prompt_counts, (_, joint) in zip(counts, exact):
        assert set(prompt_counts) <= set(joint), "sampled a sequence the model cannot produce"
        statistic, df = chi_square(prompt_counts, joint)
        assert df >= 10
        assert statistic < chi_square_critical(df), (statistic, df)


@pytest.mark.parametrize("rule", [RestMembershipRule, PathBlindChooser], ids=["rest-membership", "path-blind"])
def test_wrong_rules_fail_the_same_test(model: PreTrainedModel, exact, rule: type[TokenChooser]) -> None:
    """With half the samples, each wrong rule is rejected by a wide margin on some prompt."""
    counts = first_tokens(model, exact, samples_per_prompt=1000, rule=rule)
    ratios = [
        chi_square(c, joint)[0] / chi_square_critical(chi_square(c, joint)[1]) for c, (_, joint) in zip(counts, exact)
    ]
    assert max(ratios) > 5, ratios


# --- reproducibility ----------------------------------------------------------------------------


def test_a_fixed_seed_gives_the_same_output_with_or_without_drafts(model: PreTrainedModel, exact) -> None:
    """Each new token is drawn at a uniform number of its own output position (``TokenChooser``):
    with one generator seed, plain decoding, wide trees of the likeliest paths (mostly accepted),
    and trees for the other prompt only (mostly not) give the same tokens; another seed gives others.
    (A draw within float rounding of a token's edge could part them; these seeds draw none there.)"""

    def run(seed: int, drafter):
        generator = torch.Generator().manual_seed(seed)
        settings = GenerationConfig(**SAMPLING)
        return generate(
            model, list(PROMPTS), drafter, max_new_tokens=16, generation_config=settings, generator=generator
        )

    plain = run(7, None).output_ids
    likely = LikelyPathsDrafter({k: v for tables, _ in exact for k, v in tables.items()}, width=4)
    drafted = run(7, likely)
    assert drafted.output_ids == plain
    assert max(drafted.accepted_per_step[0]) >= NEW_TOKENS - 1, "the trees must be accepted for this to mean anything"
    assert run(7, LikelyPathsDrafter(exact[1][0])).output_ids == plain
    assert run(8, None).output_ids != plain
