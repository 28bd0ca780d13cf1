"""The adaptive drafter: every source merged into one scored tree, sized for this hardware.

Each step it drafts candidates from the static index and the store of recent outputs (one call to
the base drafter, one RPC when remote; with ``suffixes``, the index's trees for the context cut to
its last few tokens too, each a source) and from the request's own text (``RequestMatcher``),
merges them into one tree scored by estimated acceptance (``drafter.core.merge``: per-source path
probabilities, weights calibrated per source and sample size, noisy-OR) and keeps the part that
maximizes expected tokens per second of verification, (1 + sum of kept scores) / t(1 + kept)
(``drafter.core.selection.select_tree``, Sequoia's hardware-aware size). Where verifying many tokens costs
several 1-token steps, as on a CPU, that is a small tree, or none at all.

It implements the per-step protocol (``drafter.core.protocol.StepDrafter``) that the scheduler
(``drafter.core.scheduler``) runs; ``draft`` runs the same sequence at once. It keeps a session per
request the engine names (its matcher, where its context stood, the tree last verified). What the
verifier accepted is read from the tokens the request's context gained since the last step --
the accepted path of the previous tree and the verifier's bonus token -- and counted per source
(``Attribution``) before drafting again. The sources are calibrated (``SourceCalibration.observe``)
on each merged tree in hindsight, once the context has grown by its depth: every node of it that
what followed would have tried, not only the verified part. Calibrating on the verified part
alone learns nothing about a branch the selection passes over, so a source whose short matches
are underrated stays underrated (on the code tuning split of ``benchmarks.history``, at 1,936
warm-up requests, 2.88 tokens a step calibrated on the verified chain, 2.97 in hindsight). A
request not seen before, or a context that does not continue its session, starts a new session
(the calibration carries over). Outputs enter the output store only through ``add_output``, called
by whoever finished a generation.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from rest_spec.common.errors import NoOutputStoreError
from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo, SourceTrees
from rest_spec.drafter.core.batch_step import merge_rows
from rest_spec.drafter.core.calibration_memory import SAVE_EVERY, CalibrationMemory
from rest_spec.drafter.core.chain_calibration import TEMPERATURE_BOUNDS, ChainCalibration, setting_class
from rest_spec.drafter.core.corrected_cost import CorrectedCost
from rest_spec.drafter.core.cost import StepCost, VerifyCost
from rest_spec.drafter.core.cost_cache import keep_healed
from rest_spec.drafter.core.merge import Attribution, MergedTree, SourceCalibration, TreeNodes
from rest_spec.drafter.core.protocol import Drafter, Pending, SourceDrafter
from rest_spec.drafter.core.request_matcher import RequestMatcher, draft_requests, extend_requests
from rest_spec.drafter.core.selection import select_tree
from rest_spec.drafter.core.steps import Deferred, Mark, as_source, draft_step, token_list
from rest_spec.drafter.core.suffix_cache import SuffixCache

log = logging.getLogger(__name__)

SOURCES = ("index", "request", "outputs")
# and "suffix": vLLM's ``suffix`` drafter's matcher (``drafter.core.suffix_cache``, Arctic Inference)
SOURCE_NAMES = (*SOURCES, "suffix")
FEED_TOKENS = 1 << 20  # tokens of the store's new outputs the suffix source takes in at most a step
MAX_SESSIONS = 4096  # sessions kept at most; past it the longest unseen goes (an engine that never says "ended")
# Verified and matured trees counted together once this many wait: the counting's fixed cost per
# pass (tens of microseconds: a step's whole drafting at one row is a few hundred) paid once per
# many steps. The calibration learns up to this many trees late; whoever reads ``attribution`` or
# ``calibration`` sees everything counted.
COUNT_EVERY = 32
_EMPTY_TREE = DraftTree.empty()
_NONE_ACCEPTED = (0,)  # the accepted count of an empty verified tree


@dataclasses.dataclass(frozen=True)
class CutTrees(SourceTrees):
    """``SourceTrees`` with the index's trees for the context cut to each of ``suffixes`` tokens
    (empty where the cut adds nothing)."""

    shorter: tuple[DraftTree, ...] = ()


def with_cuts(trees: Sequence[SourceTrees], rows: int, suffixes: Sequence[int], n_min: int) -> list[CutTrees]:
    """``rows`` contexts' trees, then each context's cuts in ``suffixes`` order (all drafted with
    n_min 1), regrouped per context: its own trees held to ``n_min`` (as a query with it answers),
    and cut k where it matched all its k tokens and the context matched longer (a cut matches
    min(k, the context's longest match): otherwise it repeats the context's tree or a shorter cut's)."""
    grouped = []
    for i, own in enumerate(trees[:rows]):
        index, outputs = (tree if tree.match_len >= n_min else DraftTree.empty() for tree in (own.index, own.outputs))
        cuts = trees[rows + i * len(suffixes) : rows + (i + 1) * len(suffixes)]
        longest = index.match_len or n_min
        shorter = tuple(
            cut.index if cut.index.match_len == k < longest else DraftTree.empty() for k, cut in zip(suffixes, cuts)
        )
        grouped.append(CutTrees(index, outputs, shorter))
    return grouped


class _Regrouped:
    """A ``Pending`` whose answer is another's passed through ``regroup``."""

    def __init__(self, pending: Pending, regroup: Callable[[list[SourceTrees]], list[CutTrees]]) -> None:
        self.pending, self.regroup = pending, regroup

    def result(self, timeout: float | None = None) -> list[CutTrees]:
        return self.regroup(self.pending.result(timeout))

    def cancel(self) -> bool:
        return self.pending.cancel()


@dataclasses.dataclass
class _Session:
    """One request being decoded: where its context stood at the last step (``mark``, which the
    scheduler reads too: the one record of it), the tree answered then (and the merged tree it was selected from), and the matcher over its own tokens (None when
    the request source is off)."""

    matcher: RequestMatcher | None
    suffix_key: Hashable | None = None  # its request's key in the drafter's ``SuffixCache``
    mark: Mark = dataclasses.field(default_factory=lambda: Mark(0, []))
    tree: DraftTree = dataclasses.field(default_factory=DraftTree.empty)
    merged: DraftTree = dataclasses.field(default_factory=DraftTree.empty)  # what ``tree`` was selected from
    # merged trees waiting for the tokens that followed them: (context length then, the length at which
    # the tree matures (that plus its depth), the tree, tokens accepted of it, the sampling setting)
    hindsight: deque[tuple[int, int, MergedTree, list[int], int]] = dataclasses.field(default_factory=deque)
    # with a chain calibration: what the merged tree claimed of each token of ``tree`` (its conditional
    # score) and the token's group (``ChainCalibration.claims``), learned from once the chain is verified
    claims: tuple[np.ndarray, np.ndarray] | None = None
    setting: int = 0  # the sampling setting's class (``chain_calibration.setting_class``): 0, greedy


class AdaptiveDrafter:
    """A ``Drafter`` that merges the ``sources`` (any of "index", "request", "outputs") into one
    scored tree and, with a ``cost``, verifies only the part that pays on this hardware.

    base         where the index and outputs trees come from: a ``SourceDrafter`` (``LocalDrafter``,
                 ``RemoteDrafter``); a plain ``Drafter`` does when "outputs" is not a source.
                 Kept as ``source`` (``drafter.core.steps.as_source``)
    cost         the measured verification cost (``drafter.hf.measure.load_or_measure``), kept as a
                 ``CorrectedCost`` (given one, that one): the loop that verifies these trees
                 corrects it by the steps it times (``generate``), across requests; or a
                 ``BatchCost`` (an engine's step by rows and draft tokens, vLLM's); None keeps
                 the ``budget`` best-scored nodes (no hardware-aware size)
    config       how each source drafts its candidates (budget 64 per source and for the merge)
    suffixes     context cuts (descending token counts, e.g. ``SUFFIX_CUTS``) whose index trees are
                 extra sources, after ``sources`` in the calibration; needs "index"; () for none
                 (``benchmarks.merge_rules`` measures what they add)
    calibration  per-source, per-sample-class weights, learned from what followed each merged tree;
                 default: prior 1 everywhere. Shared by all greedy rows; the rows of each sampling
                 setting (``chain_calibration.setting_class``: a temperature class) learn their own
                 from its priors, since a sampled row accepts a drafted token with the probability the
                 model gives it, not when it is the argmax (``calibrations``)
    chains       verify a chain, never a branching tree: the root path that pays most under the
                 cost's chain times (``drafter.core.selection.select_chain``; needs a ``cost``), for engines
                 that verify chains only (llama.cpp, ``drafter.llamacpp.draft_model``)
    cache_healed at ``close``, cache what the steps taught a measured ``cost`` in place of the
                 cached table it started from (``drafter.core.cost_cache.keep_healed``), so the next
                 process starts healed; for a table read from or written to the cache
    calibrate_chains  with ``chains``: score each chosen chain by what such chains get accepted
                 (``drafter.core.chain_calibration``), learned from the chains verified, so that an
                 engine's batch admission weighs the tokens it will really get; the chain itself is
                 still chosen on the merged scores (vLLM's proposer)
    memory       where what the calibrations learned is kept (``drafter.core.calibration_memory``):
                 read at start, so a restarted or new replica starts calibrated, and written every
                 ``SAVE_EVERY`` seconds as requests finish and at ``close``

    With the "suffix" source over a source that holds the store of outputs in this process
    (``LocalDrafter``, with a fleet's copy or not), the suffix cache's responses are the store's:
    the newest of what it holds at start, then what it gains, every replica's (``_feed_suffix``).

    ``draft(context, config)``: the loop's ``config`` caps the verified tree (``budget`` nodes,
    ``max_depth`` levels) on top of the candidates' own config. Rows of ``draft_batch`` keep
    their own session, named by ``requests`` (default: their positions), so rows may finish and
    leave the batch. Not thread-safe: one per decoding loop.
    """

    def __init__(
        self,
        base: Drafter,
        *,
        cost: VerifyCost | StepCost | None,
        config: DraftConfig = DraftConfig(),
        sources: Sequence[str] = SOURCES,
        suffixes: Sequence[int] = (),
        calibration: SourceCalibration | None = None,
        chains: bool = False,
        cache_healed: bool = False,
        calibrate_chains: bool = False,
        memory: CalibrationMemory | None = None,
    ) -> None:
        if chains and cost is None:
            raise ValueError("choosing chains needs a verify cost")
        if calibrate_chains and not chains:
            raise ValueError("calibrate_chains needs chains")
        if cache_healed and not isinstance(cost, VerifyCost | CorrectedCost):
            raise ValueError("cache_healed needs a measured verify cost (a VerifyCost or CorrectedCost)")
        self.cache_healed = cache_healed
        self.sources = tuple(sources)
        unknown = sorted(set(self.sources) - set(SOURCE_NAMES))
        if unknown or not self.sources or len(set(self.sources)) != len(self.sources):
            raise ValueError(f"sources must be distinct names among {', '.join(SOURCE_NAMES)}, got {list(sources)}")
        # the "suffix" source's trees: every request's and every response's (vLLM's ``suffix``)
        self.suffix_cache = SuffixCache() if "suffix" in self.sources else None
        if "outputs" in self.sources and not isinstance(base, SourceDrafter):
            raise TypeError(
                f"drafting from outputs needs a SourceDrafter base (LocalDrafter, RemoteDrafter), "
                f"got {type(base).__name__}"
            )
        self.suffixes = tuple(suffixes)
        if self.suffixes and (
            "index" not in self.sources
            or list(self.suffixes) != sorted(set(self.suffixes), reverse=True)
            or self.suffixes[-1] < 1
        ):
            raise ValueError(f"suffixes must be distinct positive lengths, descending, with an index; got {suffixes}")
        num_sources = len(self.sources) + len(self.suffixes)
        self._calibration = calibration if calibration is not None else SourceCalibration(num_sources)
        if self._calibration.num_sources != num_sources:
            raise ValueError(f"calibration has {self._calibration.num_sources} sources, expected {num_sources}")
        # per sampling setting (0: greedy, ``_calibration``), each made when a row of it first drafts
        self._calibrations: dict[int, SourceCalibration] = {0: self._calibration}
        # where accepted tokens come from, per source and match length (reports; no decision reads it)
        # the calibration's sources in its order: the named ones, then the index's cuts
        self.calibrated_sources = self.sources + tuple(f"index[-{k}:]" for k in self.suffixes)
        self._attribution = Attribution(self.calibrated_sources)
        # trees verified (tree, tokens its context gained, its accepted count to fill) and matured
        # (tree, tokens that followed, the accepted count of its verified part), not counted yet
        self._verified: tuple[list[MergedTree], list[list[int]], list[list[int]]] = ([], [], [])
        # the claims of the verified chains (``_Session.claims``) and their accepted counts, to learn from
        self._claimed: list[tuple[tuple[np.ndarray, np.ndarray], list[int]]] = []
        self.chain_calibration = ChainCalibration(num_sources) if calibrate_chains else None
        # matured trees: (tree, tokens that followed, the accepted count of its verified part, setting)
        self._matured: tuple[list[MergedTree], list[list[int]], list[Sequence[int]], list[int]] = ([], [], [], [])
        self.accepted_mismatches = 0  # rows whose engine-reported tokens were not what their context gained
        self.source, self.config, self.chains = as_source(base), config, chains
        self.cost = CorrectedCost(cost) if isinstance(cost, VerifyCost) else cost
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()  # least recently seen first
        self._rows: list[_Session] = []  # the sessions of the last call's rows, in row order
        # the number of the store's next output for the suffix source's cache; None: not fed from a store
        self._fed: int | None = None
        if self.suffix_cache is not None:
            held = self.source.outputs_in_process(0, 1)
            if held is not None:
                self._fed = max(0, held[2] - self.suffix_cache.max_cached)
                while self._feed_suffix():
                    pass
        self.memory, self._saved_at = memory, time.monotonic()
        if memory is not None:
            self._recall(memory)

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        return self.draft_batch([context], config)[0]

    def draft_batch(
        self, contexts: Sequence[Sequence[int]], config: DraftConfig, requests: Sequence[Hashable] | None = None
    ) -> list[DraftTree]:
        return draft_step(self, contexts, config, requests)

    # The steps of ``drafter.core.protocol.StepDrafter``: the scheduler runs the slow ones (the
    # source's call, the merges) for likely next contexts while the model verifies the current ones.

    def advance(
        self,
        rows: Sequence[Sequence[int]],
        requests: Sequence[Hashable],
        accepted: Sequence[Sequence[int]] | None = None,
        temperatures: Sequence[float] | None = None,
    ) -> list[_Session]:
        """Each row's session: its request's, crediting what the verifier accepted of the tree
        recorded for it (the calibration learns from the merged trees in hindsight,
        ``_look_back``), or a new one for a request not seen before or a context that does not
        continue its session. What was accepted: the engine's own tokens (``accepted``) where it
        reports them for all the context gained, else what the context gained; a report that
        disagrees with the context is counted (``accepted_mismatches``) and logged once, since
        it means the engine's adapter hands contexts that are not what the engine committed.
        ``temperatures`` (None: greedy) set each row's sampling setting: the source calibration
        its tree is merged by and the chain calibration that prices its chain.
        Reads each context's new tokens and tail only."""
        self._rows = []
        if self._fed is not None:
            self._feed_suffix()
        verified, matured = self._verified, self._matured
        for i, (row, request) in enumerate(zip(rows, requests)):
            session = self._sessions.get(request)
            if session is None or not session.mark.continued_by(row):
                if session is not None:
                    self._drop(session)
                session = self._sessions[request] = _Session(RequestMatcher() if "request" in self.sources else None)
                if self.suffix_cache is not None:
                    session.suffix_key = self.suffix_cache.start(row)
                if len(self._sessions) > MAX_SESSIONS:
                    self._drop(self._sessions.popitem(last=False)[1])
            else:
                self._sessions.move_to_end(request)
                gained = session.mark.gained(row)
                if self.suffix_cache is not None:
                    self.suffix_cache.extend(session.suffix_key, gained)
                if accepted is not None and len(accepted[i]) == len(gained):
                    gained = self._engines_tokens(accepted[i], gained)
                if gained:
                    accepted_count = _NONE_ACCEPTED  # of an empty tree
                    if len(session.tree):
                        accepted_count = [0]  # filled when the verified trees are counted
                        verified[0].append(session.tree)
                        verified[1].append(gained)
                        verified[2].append(accepted_count)
                        if session.claims is not None:
                            claimed, groups = session.claims
                            self._claimed.append(((claimed[: len(session.tree)], groups), accepted_count))
                    if isinstance(session.merged, MergedTree):
                        start = session.mark.length
                        session.hindsight.append(
                            (start, start + session.merged.max_depth, session.merged, accepted_count, session.setting)
                        )
                self._look_back(session, row, matured)
            session.mark, session.tree, session.merged = Mark.of(row), _EMPTY_TREE, _EMPTY_TREE
            session.claims = None
            session.setting = 0 if temperatures is None else setting_class(temperatures[i])
            self._rows.append(session)
        if "request" in self.sources:
            extend_requests([session.matcher for session in self._rows], rows)
        if len(verified[0]) + len(matured[0]) >= COUNT_EVERY:
            self._count()
        return self._rows

    def _engines_tokens(self, told: Sequence[int], gained: list[int]) -> list[int]:
        """The engine's committed tokens of a row, checked against what its context gained."""
        told = [int(token) for token in told]
        if told != gained:
            self.accepted_mismatches += 1
            if self.accepted_mismatches == 1:
                log.warning(
                    "the engine reports committing %s but the context gained %s: its adapter hands contexts "
                    "that are not what it committed (crediting the engine's tokens)",
                    told,
                    gained,
                )
        return told

    @property
    def attribution(self) -> Attribution:
        """Where accepted tokens came from, per source and match length, every verified tree counted."""
        self._count()
        return self._attribution

    @property
    def calibration(self) -> SourceCalibration:
        """The sources' weights for greedy rows, every matured tree counted."""
        self._count()
        return self._calibration

    @property
    def calibrations(self) -> dict[int, SourceCalibration]:
        """The sources' weights per sampling setting seen (0: greedy), every matured tree counted."""
        self._count()
        return dict(self._calibrations)

    def _calibration_of(self, setting: int) -> SourceCalibration:
        calibration = self._calibrations.get(setting)
        if calibration is None:
            calibration = self._calibrations[setting] = self._calibration.fresh()
        return calibration

    def _count(self) -> None:
        """Count the waiting trees, all at once and in the order they came (as one by one): the
        verified ones along what their contexts gained (each walk fills the count of its accepted
        tokens, which its merged tree's hindsight reads), then the matured ones."""
        verified, matured = self._verified, self._matured
        num_sources = self._calibration.num_sources
        if verified[0]:
            nodes = TreeNodes.along(verified[0], verified[1], num_sources)
            self._attribution.observe_nodes(nodes)
            for accepted_count, count in zip(verified[2], nodes.accepted_count.tolist()):
                accepted_count[0] = count
        if self._claimed:
            claims, counts = zip(*self._claimed)
            self.chain_calibration.observe(claims, [count for (count,) in counts])
            self._claimed.clear()
        if matured[0]:
            in_hindsight = TreeNodes.along(*matured[:2], num_sources)
            settings = matured[3]
            if not any(settings):
                self._calibration.observe_nodes(in_hindsight)
            else:  # each setting's trees, in the order they came
                for setting in sorted(set(settings)):
                    mine = [i for i, s in enumerate(settings) if s == setting]
                    trees, followed = [matured[0][i] for i in mine], [matured[1][i] for i in mine]
                    self._calibration_of(setting).observe_nodes(TreeNodes.along(trees, followed, num_sources))
            self._attribution.observe_hindsight_nodes(in_hindsight, [count for (count,) in matured[2]])
        for waiting in (*verified, *matured):
            waiting.clear()

    def _look_back(
        self,
        session: _Session,
        row: Sequence[int],
        matured: tuple[list[MergedTree], list[list[int]], list[Sequence[int]], list[int]],
    ) -> None:
        """Add to ``matured`` (trees, the tokens that followed each, the accepted count of each's
        verified part: a one-element list ``_count`` fills, since it counts verified trees first, and
        the row's sampling setting) the
        session's merged trees whose context has since grown by the tree's depth: what the
        calibration (``SourceCalibration.observe_nodes``) and the hindsight
        (``Attribution.observe_hindsight_nodes``) count."""
        while session.hindsight:
            start, end, merged, verified, setting = session.hindsight[0]
            if len(row) < end:
                return
            session.hindsight.popleft()
            matured[0].append(merged)
            matured[1].append(token_list(row, start, end))
            matured[2].append(verified)
            matured[3].append(setting)

    def finish(self, requests: Sequence[Hashable]) -> None:
        """These requests ended: their sessions go (and, every ``SAVE_EVERY`` seconds, what the
        calibrations learned to the ``memory``)."""
        for request in requests:
            session = self._sessions.pop(request, None)
            if session is not None:
                self._drop(session)
        if self.memory is not None and time.monotonic() - self._saved_at >= SAVE_EVERY:
            self.remember()

    def _drop(self, session: _Session) -> None:
        """A session goes: its request's suffix tree with it (its response stays cached, unless the
        cache is fed from the store, where the engine puts the output)."""
        if self.suffix_cache is not None:
            self.suffix_cache.finish(session.suffix_key, keep=self._fed is None)

    def _feed_suffix(self) -> bool:
        """Put the outputs the store gained since the last read (``FEED_TOKENS`` at most) into the
        suffix source's cache of responses; whether there may be more. vLLM's ``suffix`` knows the
        responses of its own engine; a REST replica's matcher knows the fleet's, and after a restart
        what the durable store kept."""
        documents, self._fed, end = self.source.outputs_in_process(self._fed, FEED_TOKENS)
        for _, tokens in documents:
            self.suffix_cache.add_output(tokens)
        return bool(documents) and self._fed < end

    def learned(self) -> dict[str, np.ndarray]:
        """What the calibrations learned (every waiting tree counted), as ``memory`` keeps it."""
        self._count()
        arrays = {
            f"source.{setting}.{name}": table
            for setting, calibration in self._calibrations.items()
            for name, table in calibration.arrays().items()
        }
        if self.chain_calibration is not None:
            arrays.update({f"chain.{name}": table for name, table in self.chain_calibration.arrays().items()})
        return {"sources": np.array(self.calibrated_sources), **arrays}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Start from what ``learned()`` returned (of a drafter of the same sources);
        ``ValueError`` naming what does not fit."""
        saved = arrays.get("sources")
        if saved is None or saved.ndim != 1 or tuple(str(name) for name in saved) != self.calibrated_sources:
            raise ValueError(f"it was learned for other sources than {', '.join(self.calibrated_sources)}")
        self._count()
        keys = (re.fullmatch(r"source\.(\d+)\.observed", key) for key in arrays)
        settings = sorted(int(key.group(1)) for key in keys if key)
        if 0 not in settings or settings[-1] > len(TEMPERATURE_BOUNDS):
            raise ValueError(f"its sampling settings are {settings}: not 0 (greedy) to {len(TEMPERATURE_BOUNDS)}")
        loaded = {}
        for setting in settings:  # every table checked before any is taken
            loaded[setting] = self._calibration.fresh()
            loaded[setting].load({name: arrays.get(f"source.{setting}.{name}") for name in ("observed", "predicted")})
        chain = None
        if self.chain_calibration is not None and "chain.trials" in arrays:
            chain = ChainCalibration(self.chain_calibration.num_sources)
            chain.load({name: arrays.get(f"chain.{name}") for name in ("trials", "hits", "claimed")})
        self._calibration.load(loaded.pop(0).arrays())  # the greedy one stays the object given
        self._calibrations = {0: self._calibration, **loaded}
        if chain is not None:
            self.chain_calibration = chain

    def _recall(self, memory: CalibrationMemory) -> None:
        arrays = memory.load()
        if arrays is None:
            return
        try:
            self.restore(arrays)
        except ValueError as exc:
            log.warning("calibration %s does not fit this drafter (%s); learning afresh", memory.path, exc)
        else:
            log.info("calibrations from %s", memory.path)

    def remember(self) -> None:
        """Write what the calibrations learned to ``memory`` now (a failure is a warning)."""
        self._saved_at = time.monotonic()
        try:
            self.memory.save(self.learned())
        except OSError as exc:
            log.warning("what the calibrations learned was not kept in %s: %s", self.memory.path, exc)

    def record(self, trees: Sequence[DraftTree], merged: Sequence[DraftTree]) -> None:
        """The trees verified for the rows of the last ``advance``, and the merged trees they were
        selected from: what the next one credits."""
        for session, tree, whole in zip(self._rows, trees, merged):
            session.tree, session.merged = tree, whole

    def candidates(self, config: DraftConfig) -> DraftConfig:
        """How each source drafts under the loop's ``config``: this drafter's config, capped."""
        return dataclasses.replace(
            self.config,
            budget=min(self.config.budget, config.budget),
            max_depth=min(self.config.max_depth, config.max_depth),
        )

    def start_shared(self, rows: Sequence[Sequence[int]], config: DraftConfig, timeout: float | None = None) -> Pending:
        """The index and outputs trees per row (empty where off; ``CutTrees`` with the cuts when
        there are ``suffixes``), in one call to the source (``DraftSource.start_sources``)."""
        if not self.suffixes:
            return self._start_base(rows, config, timeout)
        cuts = [row[-k:] for row in rows for k in self.suffixes]
        pending = self._start_base([*rows, *cuts], dataclasses.replace(config, n_min=1), timeout)
        return _Regrouped(pending, lambda trees: with_cuts(trees, len(rows), self.suffixes, config.n_min))

    def _start_base(self, rows: Sequence[Sequence[int]], config: DraftConfig, timeout: float | None) -> Pending:
        if "index" not in self.sources and "outputs" not in self.sources:
            return Deferred(lambda: [SourceTrees(DraftTree.empty(), DraftTree.empty())] * len(rows))
        return self.source.start_sources(rows, config, outputs="outputs" in self.sources, timeout=timeout)

    def draft_rows(
        self, sessions: Sequence[_Session], shared: Sequence[SourceTrees], config: DraftConfig
    ) -> tuple[list[DraftTree], list[DraftTree]]:
        """Every row's sources merged into one scored tree (``config.budget`` nodes) and the part
        of it worth verifying on this hardware (all of it without a cost): (selected, merged).
        The requests' own trees (``request_matcher.draft_requests``), then the merges and the chains,
        each run in one compiled pass over all rows (``drafter.core.batch_step.merge_rows``)."""
        if not sessions:
            return [], []
        if "request" in self.sources:
            requests = draft_requests([session.matcher for session in sessions], config)
        else:
            requests = [DraftTree.empty()] * len(sessions)
        if self.suffix_cache is not None:
            suffixes = self.suffix_cache.draft(
                [session.suffix_key for session in sessions],
                [session.mark.tail for session in sessions],
                config.max_depth,
            )
        else:
            suffixes = [DraftTree.empty()] * len(sessions)
        rows = [self._row_trees(*row) for row in zip(shared, requests, suffixes)]
        match_len = np.array([[tree.match_len for tree in row] for row in rows], dtype=np.int64)
        weights = self._weights(sessions, match_len, config.max_depth)
        prices = None
        if self.cost is not None and self.chains:
            prices = np.asarray(self.cost.chain(np.arange(1, config.max_depth + 2)), dtype=np.float64)
        merged, chains = merge_rows(rows, weights, config.budget, prices)
        if chains is not None:
            if self.chain_calibration is not None:
                chains = self._calibrated(sessions, chains)
            return chains, merged
        if self.cost is None:
            return merged, merged
        return [select_tree(tree, self.cost) for tree in merged], merged

    def _weights(self, sessions: Sequence[_Session], match_len: np.ndarray, depths: int) -> np.ndarray:
        """Each row's sources' weights (``SourceCalibration.weights_for``) by its sampling setting's calibration."""
        settings = np.fromiter((session.setting for session in sessions), np.int64, len(sessions))
        if not settings.any():
            return self._calibration.weights_for(match_len, depths)
        weights = np.empty((*match_len.shape, depths, self._calibration.observed.shape[2]))
        for setting in np.unique(settings).tolist():
            mine = settings == setting
            weights[mine] = self._calibration_of(setting).weights_for(match_len[mine], depths)
        return weights

    def _calibrated(self, sessions: Sequence[_Session], chains: list[DraftTree]) -> list[DraftTree]:
        """Each chain scored by the chain calibration, what it claimed kept in its session."""
        scored = []
        for session, chain in zip(sessions, chains):
            if not len(chain):
                session.claims = None
                scored.append(chain)
                continue
            session.claims = self.chain_calibration.claims(chain, session.setting)
            scored.append(chain.rescored(self.chain_calibration.scores_of(*session.claims)))
        return scored

    def _row_trees(self, shared: SourceTrees, request: DraftTree, suffix: DraftTree) -> list[DraftTree]:
        """A row's trees in calibration order: the sources', then the index's for each cut."""
        by_source = {"index": shared.index, "outputs": shared.outputs, "request": request, "suffix": suffix}
        # trees fetched without the cuts (the scheduler's speculation) have none
        shorter = shared.shorter if isinstance(shared, CutTrees) else (DraftTree.empty(),) * len(self.suffixes)
        return [by_source[s] for s in self.sources] + list(shorter)

    def add_output(self, tokens: Sequence[int]) -> int:
        """Store a finished generation in the base's output store (later requests draft from it);
        returns its sequence number."""
        if not isinstance(self.source, SourceDrafter):
            raise NoOutputStoreError(f"{type(self.source).__name__} keeps no outputs")
        return self.source.add_output(tokens)

    def warm_up(self) -> float:
        """Load every compiled kernel a step runs in this process -- the source's (``DraftSource.warm_up``),
        the request's match, the merge and its counting, the batch step -- so that the first
        request does not pay for them: numba loads each from its on-disk cache at its first call,
        ~70 ms apiece on a 2-core CPU, ~0.5 s in a vLLM engine's first steps; the seconds it took."""
        from rest_spec.drafter.core import batch_step, merge, request_matcher

        start = time.perf_counter()
        self.source.warm_up()
        for module in (request_matcher, merge, batch_step):
            module.compile_kernels()
        return time.perf_counter() - start

    def info(self) -> IndexInfo:
        return self.source.info()

    def close(self) -> None:
        try:
            if self.memory is not None:
                self.remember()
            if self.cache_healed:
                keep_healed(self.cost)
        finally:
            self.source.close()

    def __enter__(self) -> AdaptiveDrafter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
