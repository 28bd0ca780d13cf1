"""What a chosen chain's scores are worth: the merged score calibrated on the chains verified.

``SourceCalibration`` weighs each source on every node of the merged trees in hindsight, and that
leaves two things running high on the chain an engine verifies: the merged score (a noisy-OR of
sources that often saw the same text, an output also in the index) and the choice itself (the
chain picked as the best of several is, on average, one whose score erred upward). In vLLM the
kept chains' scores summed to 1.18-1.32x the tokens accepted (``benchmarks/README.md``), so the
batch admitted draft slots that did not pay.

``ChainCalibration`` learns, from the chains verified, how often a chain's token is accepted once
the tokens before it were, as a function of what the merged tree claimed for it (its conditional
score, score / parent's score), per group: the row's sampling setting (greedy, or a temperature
class), the token's leading source (the source that gave it its highest probability) and the class
of that source's match the chain was drafted from. Histogram cells over [0, 1] (a claim of 1 a cell
of its own), each pulled by ``PRIOR_TRIALS`` pseudo-trials toward its claim scaled as
its group errs over all its cells (a group with little evidence as its source errs; before any
trial, toward the claim, at ``COLD_SHARE`` for short matches), made monotone by pooling adjacent
violators, read between the cells' points, fading with a half-life in trials so that a store of outputs that grows is followed.
A chain's calibrated path scores are the running product of the mapped conditionals: they never grow
down the chain, and their sum is the tokens the chain is expected to get accepted, what the batch
admission (``select_batch_chains``) weighs against the step's price. The chain itself is still
chosen on the merged scores; the calibration only decides how much of it is worth verifying.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rest_spec.common.types import DraftTree
from rest_spec.drafter.core.merge import MATCH_LENGTH_EDGES, length_class

CELLS = 21  # cells of the claimed conditional score: 20 of equal width over [0, 1), and claims of 1
PRIOR_TRIALS = 8.0  # pseudo-trials at each cell's claim, scaled by its source's overall error
# Before its source has any trial, a chain's claims from a match shorter than ``COLD_BELOW`` are taken
# at this share: merged scores claim 2.3-2.8x what fresh replicas get (benchmarks.history, 64 replicas
# of one request each), the short matches' most. Chosen on the tuning split (--tune 64, warm-up
# requests 1-64 held out; a share for every match 1.0, 0.75, 0.6, 0.4): at 64 fresh replicas REST /
# suffix modeled 0.90 / 0.96 / 0.94 / 0.85 (code), 0.96 / 1.05 / 1.06 / 1.01 (chat); 0.75 below 8
# tokens only: 0.99 and 1.06 (and a fresh engine drafts a stored output whole); one replica 1.04 and
# 1.08 whatever the share (it learns within a request).
COLD_SHARE = 0.75
COLD_BELOW = 8  # matches this long or longer are taken at their claim: their chains claimed 0.87-1.10x what they got
HALF_LIFE = 4096  # trials after which earlier ones count half
REFIT_EVERY = 64  # trials between refits of the map
# The sampling settings calibrated apart, by temperature: greedy (0), then up to each bound. Sampled,
# a drafted token is accepted with the probability the model gives it, not when it is the argmax:
# the same claim is worth less the hotter the sampling.
TEMPERATURE_BOUNDS = (0.0, 0.5, 0.85)


def setting_class(temperature: float | None) -> int:
    """The class of a sampling temperature (None or 0: greedy, class 0), ``TEMPERATURE_BOUNDS``."""
    if temperature is None or temperature <= 0:
        return 0
    return int(np.searchsorted(TEMPERATURE_BOUNDS, temperature, side="left"))


def _pool_adjacent_violators(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest ``values`` in weighted least squares (one row)."""
    blocks: list[list[float]] = []  # [mean, weight, cells]
    for value, weight in zip(values.tolist(), weights.tolist()):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, total, cells = blocks.pop()
            before = blocks[-1]
            merged = before[1] + total
            before[0] = (before[0] * before[1] + mean * total) / merged
            before[1], before[2] = merged, before[2] + cells
    return np.repeat([mean for mean, _, _ in blocks], [cells for _, _, cells in blocks])


Claims = tuple[np.ndarray, np.ndarray]  # per token of a chain: its claimed conditional score, its group


class ChainCalibration:
    """The map from a chain token's claimed conditional score to how often such tokens are
    accepted, per group: the row's sampling setting (``setting_class``), the token's leading source
    and the class of that source's match (``drafter.core.merge.length_class``). Every token of a
    chain drafted from a 2-token match is in that match's group, however deep: on held-out replays
    the short matches' chains claimed 1.5x what they got when their deeper tokens were pooled with
    the first tokens of longer matches (as ``SourceCalibration`` pools them, a branch that has held
    counting as a longer match). A group with little evidence follows its source's in that
    setting. ``observe`` chains with the tokens accepted of each; ``scores`` a chain's calibrated
    path scores. Not thread-safe: one per drafter."""

    def __init__(self, num_sources: int = 1) -> None:
        if num_sources < 1:
            raise ValueError(f"num_sources must be positive, got {num_sources}")
        self.num_sources = num_sources
        self.lengths = len(MATCH_LENGTH_EDGES)
        self.settings = len(TEMPERATURE_BOUNDS) + 1
        groups = self.settings * num_sources * self.lengths
        # each cell's centre: an empty cell's point of the map (a claim of 1 has a cell of its own:
        # one continuation seen is the commonest claim, and the least sure)
        self.centres = np.append((np.arange(CELLS - 1) + 0.5) / (CELLS - 1), 1.0)
        self._trials = np.zeros((groups, CELLS))
        self._hits = np.zeros((groups, CELLS))
        self._claimed = np.zeros((groups, CELLS))  # sum of the claims observed per cell
        self.trials = 0  # every trial observed
        # what a claim is taken at before its source's first trial, per match class (``COLD_SHARE``)
        self._cold = np.where(np.asarray(MATCH_LENGTH_EDGES) < COLD_BELOW, COLD_SHARE, 1.0)[None, :]
        # the map, [G, CELLS]: each cell's mean claim (``_points``) and the rate accepted there (``_map``);
        # before any trial, the claims at the cold share
        self.fit()

    @staticmethod
    def _cells(conditional: np.ndarray) -> np.ndarray:
        return np.minimum((np.clip(conditional, 0.0, 1.0) * (CELLS - 1)).astype(np.int64), CELLS - 1)

    def claims(self, chain: DraftTree, setting: int = 0) -> Claims:
        """What the merged tree claimed of each of ``chain``'s tokens (root first) for a row of
        sampling ``setting``: its conditional score (score over its parent's) and its group (the
        setting; the leading source, the one that gave it its highest probability, 0 where the
        chain has no per-source columns; and the match class)."""
        scores = np.asarray(chain.scores, np.float64)
        above = np.concatenate(([1.0], scores[:-1]))
        claimed = np.divide(scores, above, out=np.zeros_like(scores), where=above > 0)
        probs = getattr(chain, "source_probs", None)
        if probs is not None and probs.ndim == 2 and probs.shape == (len(chain), self.num_sources):
            leading = np.argmax(probs, axis=1)
            matched = np.asarray(chain.source_match_len)[leading]
        else:
            leading, matched = np.zeros(len(chain), np.int64), np.full(len(chain), chain.match_len)
        source = setting * self.num_sources + leading
        return claimed, source * self.lengths + length_class(matched)

    def scores_of(self, claimed: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """The calibrated path scores of a chain with these ``claims``: the running product of each
        token's mapped conditional (the map read between its cells' points), the expected acceptance
        of each token."""
        conditional = np.empty(claimed.shape, np.float64)
        for group in np.unique(groups).tolist():
            mine = groups == group
            conditional[mine] = np.interp(claimed[mine], self._points[group], self._map[group])
        return np.cumprod(np.clip(conditional, 0.0, 1.0))

    def scores(self, chain: DraftTree, setting: int = 0) -> np.ndarray:
        """``chain``'s calibrated path scores (root first) for a row of sampling ``setting``."""
        return self.scores_of(*self.claims(chain, setting))

    def observe(self, claims: Sequence[Claims], accepted: Sequence[int]) -> None:
        """Chains with these ``claims`` (``claims``; each cut to the tokens verified) were verified
        and the first ``accepted[i]`` tokens of chain i accepted: each token up to the first rejected
        is a trial, a hit when accepted."""
        tried = [min(int(n) + 1, len(claimed)) for (claimed, _), n in zip(claims, accepted)]
        if not sum(tried):
            return
        conditional = np.concatenate([claimed[:t] for (claimed, _), t in zip(claims, tried)])
        groups = np.concatenate([group[:t] for (_, group), t in zip(claims, tried)])
        hit = np.concatenate([np.arange(t) < int(n) for t, n in zip(tried, accepted)]).astype(np.float64)
        fade = 0.5 ** (conditional.size / HALF_LIFE)
        for table in (self._trials, self._hits, self._claimed):
            table *= fade
        cells = self._cells(conditional)
        np.add.at(self._trials, (groups, cells), 1.0)
        np.add.at(self._hits, (groups, cells), hit)
        np.add.at(self._claimed, (groups, cells), conditional)
        self.trials += conditional.size
        self._since_fit += conditional.size
        if self._since_fit >= REFIT_EVERY:
            self.fit()

    def fit(self) -> None:
        """Re-map from the trials so far (see the module)."""
        self._since_fit = 0
        self._points = (self._claimed + PRIOR_TRIALS * self.centres) / (self._trials + PRIOR_TRIALS)
        # a cell with little evidence follows its group's claims scaled as the group errs overall,
        # and a group with little its source's
        hits = self._hits.reshape(-1, self.lengths, CELLS).sum(axis=2)  # [settings x sources, lengths]
        claimed = self._claimed.reshape(-1, self.lengths, CELLS).sum(axis=2)
        source = (hits.sum(axis=1, keepdims=True) + PRIOR_TRIALS * self._cold) / (
            claimed.sum(axis=1, keepdims=True) + PRIOR_TRIALS
        )  # [settings x sources, lengths]: the source's error, or before its first trial the cold share
        group = (hits + PRIOR_TRIALS * source) / (claimed + PRIOR_TRIALS)
        prior = np.minimum(self.centres * group.reshape(-1, 1), 1.0)
        rate = (self._hits + PRIOR_TRIALS * prior) / (self._trials + PRIOR_TRIALS)
        self._map = rate  # a group never tried is its prior, monotone already: most groups, most fits
        for g in np.flatnonzero(self._trials.any(axis=1)).tolist():
            self._map[g] = _pool_adjacent_violators(rate[g], self._trials[g] + PRIOR_TRIALS)

    @property
    def table(self) -> np.ndarray:
        """[T x S x L, CELLS]: the accepted rate mapped to each cell of claimed conditional score,
        per group (setting t, source s, match class l: row (t * S + s) * L + l; read-only)."""
        view = self._map.view()
        view.flags.writeable = False
        return view

    def arrays(self) -> dict[str, np.ndarray]:
        """What it learned (the faded trials, hits and claims per group and cell): what
        ``drafter.core.calibration_memory`` keeps for the next process (``load``)."""
        return {"trials": self._trials.copy(), "hits": self._hits.copy(), "claimed": self._claimed.copy()}

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Start from what ``arrays`` (an earlier ``arrays()``) learned; ``ValueError`` naming the
        problem for tables of another shape (other sources) or that no run could have learned
        (negative, not finite, more hits or claims than trials), leaving this one as it was."""
        tables = [np.asarray(arrays.get(name), dtype=np.float64) for name in ("trials", "hits", "claimed")]
        trials, hits, claimed = tables
        for name, table in zip(("trials", "hits", "claimed"), tables):
            if table.shape != self._trials.shape:
                raise ValueError(f"chain calibration {name} has shape {table.shape}, expected {self._trials.shape}")
            if not np.all(np.isfinite(table)) or np.any(table < 0):
                raise ValueError(f"chain calibration {name} holds negative or non-finite counts")
        slack = 1e-6 * (1.0 + trials)
        if np.any(hits > trials + slack) or np.any(claimed > trials + slack):
            raise ValueError("chain calibration holds more hits or claims than trials")
        self._trials, self._hits, self._claimed = trials.copy(), hits.copy(), claimed.copy()
        self.trials = int(round(float(trials.sum())))
        self.fit()

    def state(self) -> dict:
        """The trials and hits per source and cell, and the map: what a report shows."""
        return {
            "trials": int(self.trials),
            "cells": CELLS,
            "map": np.round(self._map, 4).tolist(),
            "cell_trials": np.round(self._trials, 1).tolist(),
        }
