"""vLLM's ``suffix`` drafter's matcher as a source of the merge: REST drafts at least what it drafts.

vLLM's built-in ``suffix`` method (SuffixDecoding, arXiv 2411.04975) wraps Arctic Inference's
``SuffixDecodingCache``: a suffix tree of each active request's prompt and response, and one of
every response the engine has produced, each answering the likeliest continuation of the
context's longest matching suffix (up to 24 tokens), frequency-weighted, cut where its path
probability falls under 0.1 and at the match's length. ``SuffixCache`` is that cache, fed the
same way (``start`` with the prompt, ``extend`` with each step's new tokens, which go into the
request's tree and the cache of responses as vLLM's proposer feeds them) and asked with vLLM's
settings, plus what only a REST replica has: ``add_output`` puts any output in the cache of
responses -- the fleet's, copied from the shared store, and those replayed at start -- not only
this engine's.

Its chain enters ``drafter.core.merge`` as the source "suffix", scored by the cache's own path
probabilities. A chain proposed by suffix alone keeps that score under its calibration; so the
merge's chain is chosen over a set that holds suffix's, by the same calibrated estimates, and the
index and the store of outputs can only add to it.

Arctic Inference is an optional dependency (``pip install rest-spec[suffix]``; vLLM's ``suffix``
needs it too): ``available()`` says whether it imports.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from rest_spec.common.types import DraftTree

# vLLM's ``suffix`` defaults (``SpeculativeConfig.suffix_decoding_*``), which its benchmark here runs
TREE_DEPTH = 24
MAX_CACHED_RESPONSES = 10000
MIN_TOKEN_PROB = 0.1
SPEC_FACTOR = 1.0
# The cache gives path probabilities, not counts; the merge reads a node's sample class from its
# parent's count, so counts are the probabilities at this scale (a certain node: class 4 of 1..16).
NOMINAL_SAMPLES = 16


def available() -> bool:
    """Whether Arctic Inference (the ``suffix`` source's matcher) is installed."""
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        return False
    return True


class SuffixCache:
    """The suffix trees of the requests being decoded and of every output seen, drafting as
    vLLM's ``suffix`` drafts (its settings by default). One per drafter; not thread-safe.

    A request is known by the key ``start`` returns; ``finish`` drops its tree (its response stays
    in the cache of responses, the oldest evicted past ``max_cached`` responses)."""

    def __init__(
        self,
        tree_depth: int = TREE_DEPTH,
        max_cached: int = MAX_CACHED_RESPONSES,
        min_token_prob: float = MIN_TOKEN_PROB,
        spec_factor: float = SPEC_FACTOR,
    ) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as exc:
            raise ImportError(
                "the suffix source needs Arctic Inference (pip install arctic-inference; "
                "scripts/setup-vllm.sh installs it)"
            ) from exc
        if tree_depth < 1 or max_cached < 1 or not 0 <= min_token_prob <= 1 or spec_factor < 0:
            raise ValueError(
                f"tree_depth and max_cached must be positive, min_token_prob in [0, 1] and spec_factor >= 0; "
                f"got {tree_depth}, {max_cached}, {min_token_prob}, {spec_factor}"
            )
        self.tree_depth, self.min_token_prob, self.spec_factor = tree_depth, min_token_prob, spec_factor
        self.max_cached = max_cached
        self._cache = SuffixDecodingCache(max_tree_depth=tree_depth, max_cached_requests=max_cached)
        self._keys = itertools.count()

    def start(self, prompt: Sequence[int] | np.ndarray) -> Hashable:
        """A new request whose text so far is ``prompt``; its key."""
        key = next(self._keys)
        self._cache.start_request(key, _int32(prompt))
        return key

    def extend(self, key: Hashable, tokens: Sequence[int] | np.ndarray) -> None:
        """The request's new tokens: into its own tree and its response in the cache."""
        if len(tokens):
            self._cache.add_active_response(key, _int32(tokens))

    def finish(self, key: Hashable, keep: bool = True) -> None:
        """The request ended (or its session went): its tree goes, its response stays cached unless
        not ``keep`` (a cache fed from a store of outputs gets it back from there, once)."""
        if key in self._cache.active_requests:
            self._cache.stop_request(key)
        if not keep and key in self._cache.cached_requests:
            self._cache.evict_cached_response(key)

    def add_output(self, tokens: Sequence[int] | np.ndarray) -> None:
        """A finished output from anywhere (another replica, the durable store) into the cache of
        responses."""
        key = self.start(())
        self.extend(key, tokens)
        self.finish(key)

    def draft(self, keys: Sequence[Hashable], tails: Sequence[Sequence[int]], max_depth: int) -> list[DraftTree]:
        """Each request's chain (at most ``max_depth`` tokens) for its context, of which ``tails``
        holds at least the last ``tree_depth`` tokens: the better-scored of its own tree's and
        the responses' answers, as vLLM's ``suffix`` drafts it."""
        trees = []
        for key, tail in zip(keys, tails):
            draft = self._cache.speculate(
                key,
                _int32(tail[-self.tree_depth :]),
                max_spec_tokens=max_depth,
                max_spec_factor=self.spec_factor,
                min_token_prob=self.min_token_prob,
            )
            trees.append(_as_tree(draft))
        return trees

    def __len__(self) -> int:
        """The responses cached."""
        return len(self._cache.cached_requests)


def _int32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int32)


def _as_tree(draft) -> DraftTree:
    """The cache's answer as a scored ``DraftTree`` (its probabilities are the nodes' path
    probabilities; ``NOMINAL_SAMPLES`` stands for the counts it does not give)."""
    if not draft.token_ids:
        return DraftTree.empty()
    scores = np.minimum.accumulate(np.clip(np.asarray(draft.probs, dtype=np.float64), 0.0, 1.0))
    return DraftTree(
        tokens=np.asarray(draft.token_ids, dtype=np.int32),
        parents=np.asarray(draft.parents, dtype=np.int32),
        counts=np.ceil(scores * NOMINAL_SAMPLES).astype(np.int64),
        match_len=int(draft.match_len),
        num_matches=NOMINAL_SAMPLES,
        num_sampled=NOMINAL_SAMPLES,
        scores=scores,
    )
