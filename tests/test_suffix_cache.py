"""vLLM's ``suffix`` matcher as a source of the merge (``drafter.core.suffix_cache``): it drafts
exactly what Arctic Inference's cache, fed as vLLM's proposer feeds it, drafts; the adaptive drafter
keeps one tree per session and lets it go with the session; a merge with it holds suffix's chain;
over a store of outputs its responses are the store's. Needs Arctic Inference (``.venv-vllm``, where vLLM's ``suffix`` needs it too); without it, asking
for the source says what to install."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.suffix_cache import SuffixCache
from rest_spec.drafter.vllm.proposer import RestOptions
from tests.helpers import MODEL_VOCAB, write_index


def test_without_arctic_inference_the_source_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # an import of it fails
    from rest_spec.drafter.core import suffix_cache

    assert not suffix_cache.available()
    with LocalDrafter.open(write_index(tmp_path / "idx", [[1, 2, 3]], MODEL_VOCAB)) as base:
        with pytest.raises(ImportError, match="the suffix source needs Arctic Inference"):
            AdaptiveDrafter(base, cost=None, sources=("index", "suffix"))


def test_the_option_turns_the_source_on_off_or_leaves_it_to_the_install():
    assert RestOptions.parse({"datastore": "idx"}, environ={}).suffix_cache is None
    assert RestOptions.parse({"datastore": "idx"}, environ={"REST_SUFFIX_CACHE": "no"}).suffix_cache is False
    assert RestOptions.parse({"datastore": "idx", "suffix_cache": True}, environ={}).suffix_cache is True


@pytest.fixture
def arctic():
    return pytest.importorskip(
        "arctic_inference.suffix_decoding", reason="Arctic Inference is not installed here: use .venv-vllm"
    )


def _texts(seed: int, count: int, length: int, vocab: int = 12) -> list[list[int]]:
    """Repetitive token streams over a small vocabulary: long suffix matches, branching continuations."""
    rng = np.random.default_rng(seed)
    motifs = [list(rng.integers(0, vocab, 6)) for _ in range(4)]
    return [
        [
            int(t)
            for _ in range(length)
            for t in (motifs[rng.integers(4)] if rng.random() < 0.7 else [rng.integers(vocab)])
        ]
        for _ in range(count)
    ]


@pytest.mark.parametrize("seed", range(3))
def test_it_drafts_what_vllms_suffix_drafts_fed_the_same_way(arctic, seed):
    """Served responses, then a request decoded step by step: at every step the chain is the one
    ``SuffixDecodingCache`` answers with vLLM's settings, its scores the cache's path probabilities."""
    *served, prompt, response = _texts(seed, 6, 12)
    ours, theirs = SuffixCache(), arctic.SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000)
    for i, output in enumerate(served):
        ours.add_output(output)
        theirs.start_request(f"served-{i}", np.zeros(0, np.int32))
        theirs.add_active_response(f"served-{i}", output)
        theirs.stop_request(f"served-{i}")
    key = ours.start(prompt)
    theirs.start_request("r", np.asarray(prompt, np.int32))
    context, drafted = list(prompt), 0
    for token in response:
        chain = ours.draft([key], [context], 8)[0]
        draft = theirs.speculate(
            "r", np.asarray(context[-24:], np.int32), max_spec_tokens=8, max_spec_factor=1.0, min_token_prob=0.1
        )
        assert chain.tokens.tolist() == list(draft.token_ids)
        assert chain.scores == pytest.approx(draft.probs, abs=1e-6) and chain.match_len == draft.match_len
        assert np.all(np.diff(chain.scores) <= 0) and list(chain.parents) == list(range(-1, len(chain) - 1))
        drafted += len(chain)
        ours.extend(key, [token])
        theirs.add_active_response("r", [token])
        context.append(token)
    assert drafted > len(response)  # the streams repeat: most steps draft
    ours.finish(key)
    assert len(ours) == len(served) + 1  # the finished response stays cached


@pytest.fixture
def base(arctic, tmp_path):
    """An index without a store of outputs: the suffix source keeps this engine's responses itself, as
    vLLM's ``suffix`` does (with a store it takes them from there: ``test_calibration_memory``)."""
    index = write_index(tmp_path / "idx", [list(range(20, 60))], MODEL_VOCAB)
    with LocalDrafter.open(index, outputs_max_tokens=0) as base:
        yield base


def test_the_drafter_holds_suffixs_chain_and_a_tree_per_session(base):
    """Sources "suffix" alone: the merged tree is suffix's chain (a one-source merge is that source's
    tree); each request keeps its tree while its session lives, and what it generated serves the
    next request."""
    config = DraftConfig(budget=16, max_depth=8)
    drafter = AdaptiveDrafter(base, cost=None, config=config, sources=("suffix",))
    text = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8]
    tree = drafter.draft_batch([text], config, ["a"])[0]
    assert tree.tokens.tolist() == [9, 10, 11, 7, 8, 9, 10, 11][: len(tree)] and len(tree) >= 3
    assert len(drafter.suffix_cache._cache.active_requests) == 1
    drafter.draft_batch([[*text, 9, 10]], config, ["a"])  # the same request, continued: the same tree
    assert len(drafter.suffix_cache._cache.active_requests) == 1
    drafter.draft_batch([[1, 2, 3]], config, ["a"])  # a context that does not continue it: a new session
    assert len(drafter.suffix_cache._cache.active_requests) == 1
    drafter.finish(["a"])
    assert not drafter.suffix_cache._cache.active_requests and len(drafter.suffix_cache) == 2
    # the first session's response (9 10 after its prompt) is in the cache: a new request draws on it
    assert drafter.draft_batch([[5, 8, 9]], config, ["b"])[0].tokens.tolist()[:1] == [10]


def test_with_the_index_suffixs_chain_stays_a_branch_of_the_merge(base):
    config = DraftConfig(budget=32, max_depth=8)
    drafter = AdaptiveDrafter(base, cost=None, config=config, sources=("index", "request", "outputs", "suffix"))
    context = [7, 8, 9, 30, 31, 7, 8, 9, 30, 31, 7, 8]
    merged = drafter.draft_batch([context], config, ["a"])[0]
    theirs = drafter.suffix_cache.draft([drafter._sessions["a"].suffix_key], [context], 8)[0]
    assert len(theirs) and set(theirs.paths()) <= set(merged.paths())


def test_with_a_store_of_outputs_the_suffix_source_holds_what_the_store_holds(arctic, tmp_path):
    """The store's outputs at start (a restart reloads them) and those it gains (another replica's)
    are suffix's responses; this engine's own output enters once, through the store."""
    config = DraftConfig(budget=16, max_depth=8)
    index = write_index(tmp_path / "idx", [list(range(20, 60))], MODEL_VOCAB)
    with LocalDrafter.open(index, outputs_max_tokens=10_000, outputs_dir=tmp_path / "outputs") as base:
        base.add_output([5, 6, 7, 8, 9, 10])
    with LocalDrafter.open(index, outputs_max_tokens=10_000, outputs_dir=tmp_path / "outputs") as base:
        drafter = AdaptiveDrafter(base, cost=None, config=config, sources=("suffix",))
        assert len(drafter.suffix_cache) == 1  # the durable store's, replayed at start
        assert drafter.draft_batch([[1, 6, 7]], config, ["a"])[0].tokens.tolist()[:2] == [8, 9]
        base.add_output([40, 41, 42, 43, 44])  # another replica's output, reaching this one's store
        assert drafter.draft_batch([[1, 41, 42]], config, ["b"])[0].tokens.tolist()[:2] == [43, 44]
        drafter.finish(["a", "b"])
        assert len(drafter.suffix_cache) == 2  # the finished requests' responses wait for the store
        base.add_output([1, 41, 42, 43])  # the engine stores b's output: it enters once
        drafter.draft_batch([[3]], config, ["c"])
        drafter.finish(["c"])  # c's output is never stored: the cache does not keep it either
        assert len(drafter.suffix_cache) == 3


def test_over_a_server_the_suffix_source_keeps_this_engines_responses(arctic, tmp_path):
    """A store of outputs on a server (no copy in this process): the suffix source asks it nothing
    and keeps this engine's responses itself, as vLLM's ``suffix`` does."""
    from rest_spec.datastore.index import Datastore
    from rest_spec.datastore.server import DatastoreServer, ServerConfig
    from rest_spec.drafter.core.remote import RemoteDrafter

    config = DraftConfig(budget=16, max_depth=8)
    index = write_index(tmp_path / "idx", [list(range(20, 60))], MODEL_VOCAB)
    with (
        Datastore.open(index) as store,
        DatastoreServer(store, ServerConfig(port=0, workers=2)) as server,
        RemoteDrafter(server.address) as remote,
    ):
        drafter = AdaptiveDrafter(remote, cost=None, config=config, sources=("suffix",))
        drafter.draft_batch([[7, 8]], config, ["a"])
        drafter.draft_batch([[7, 8, 9, 10, 11]], config, ["a"])  # its response: 9 10 11
        drafter.finish(["a"])
        assert len(drafter.suffix_cache) == 1
        assert drafter.draft_batch([[1, 8, 9]], config, ["b"])[0].tokens.tolist() == [10]  # a 1-token match: 1 token
