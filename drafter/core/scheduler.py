"""The draft scheduler: every decoding loop's drafts, step by step, through the drafting protocol
(``drafter.core.protocol.StepDrafter``). Remote drafts have deadlines, and a late or dead datastore
means a local draft, never a stalled or failed generation. In its overlap mode (``OverlapConfig``)
step k+1's drafts are prepared while the model verifies step k (PipeInfer: speculation beside
verification, stale speculation cancelled, committed state kept apart from speculative state);
without it each step drafts after the previous forward.

Before each forward, ``DraftScheduler.speculate`` takes the most likely outcomes of the tree about to
be verified -- the accepted path ends at node v (or at the root) with probability
score(v) - sum of its children's scores -- and, for each, asks the datastore for the context
extended by that path, one level deeper, one token shorter in its suffix bounds and wider than a
step's tree (``ahead_config``), and for its cuts (``SUFFIX_CUTS``): the next step's context is that plus the verifier's bonus token,
which nobody knows yet, and the tree under that token (``DraftTree.after``) is what the step
would draft once the token is known, whenever the match extends by it. One call (one RPC)
carries every hypothesis of every row; a background thread waits for it (or, in process, does
the search, beside the forward). After the forward, ``DraftScheduler.trees`` reads each row's outcome
from its new context: a foreseen outcome whose bonus token continues the index's match takes
the trees under it; any other row gets its sources fetched now. The request's own text is
matched on the spot (it is local and cheap), and the sources are merged and sized as the
drafter always does. When no row's outcome was foreseen the call in flight is cancelled,
server-side work included.

Deadlines follow the step time (the median of recent forwards): a speculative reply may arrive
up to ``deadline`` of a step after the forward ends, a fresh draft may keep the loop waiting at
most that long. A reply that is late, or a datastore that fails (unreachable, overloaded,
corrupt, frozen), costs that step its shared sources: it drafts from the request's own text alone
(the adaptive drafter) or verifies no draft. A few such steps in a row open the datastore's
circuit breaker (``drafter.core.breaker``; a ``RemoteDrafter`` keeps its own across generations): the
steps after it do not ask the datastore at all, and once in a while one of them sends a probe that
no step waits for; the first probe answered in time closes the breaker. Verification is lossless
whatever tree it gets, so output never changes.

Whether a step drafts at all is decided here too, by the one rule every engine follows
(``worth.DraftingWorth``, where the drafter has a cost to price a step by): a step that drafted is
weighed by its trees' expected gain against their verification and the drafting's own time, and
where drafting does not pay at a batch size the next steps at that size skip it. A skipped step
means one thing for every engine: its rows decode on without drafts; the trees recorded for them
were verified by the step that just ran and are credited to the sources (``StepDrafter.advance``)
before they are dropped, and nothing is credited for the skipped step itself. When every request of
the last step has ended, the rule starts over (a new request, where an engine runs one at a time).

Speculation needs a source that reads only a context's suffix (``DraftSource.reads_suffixes``):
it sends contexts cut short. The background thread touches no drafter state (request matchers,
calibration): only the decoding thread does, and speculative contexts are never committed.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections import deque
from collections.abc import Hashable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field

import numpy as np

from rest_spec.common.types import MAX_BUDGET, MAX_DEPTH, DraftConfig, DraftTree, SourceTrees
from rest_spec.drafter.core.breaker import Admission, CircuitBreaker
from rest_spec.drafter.core.cost import StepCost
from rest_spec.drafter.core.protocol import BatchRule, Drafter, Pending
from rest_spec.drafter.core.steps import SUFFIX_CUTS, Mark, finish_step, steps_for
from rest_spec.drafter.core.worth import DraftingWorth

log = logging.getLogger(__name__)

AHEAD_WIDTH = 4  # a hypothesis's tree holds this many step trees' worth of nodes
MIN_WAIT = 0.005  # seconds: a loopback or same-rack round trip with room to spare
NO_SOURCES = SourceTrees(DraftTree.empty(), DraftTree.empty())
# What a datastore that cannot answer raises: unreachable or late (ConnectionError, TimeoutError),
# failing server-side (RuntimeError: RESOURCE_EXHAUSTED, DATA_LOSS, ...). A ValueError is a bad
# request, a bug to report, not a datastore to route around.
DATASTORE_FAILURES = (ConnectionError, TimeoutError, RuntimeError)


@dataclass(frozen=True)
class OverlapConfig:
    """How drafting runs beside verification.

    enabled        prepare step k+1's drafts during step k's forward (False: draft after it);
                   only for sources that read a context's suffix alone (``reads_suffixes``)
    hypotheses     accepted-path outcomes per row drafted ahead, most likely first
    deadline       the longest a datastore reply may keep the loop waiting, as a share of the
                   step time (at least ``MIN_WAIT``); past it the step drafts from local sources only
    """

    enabled: bool = True
    hypotheses: int = 3
    deadline: float = 0.25

    def __post_init__(self) -> None:
        if self.hypotheses < 1 or not self.deadline > 0:
            raise ValueError(f"hypotheses must be >= 1 and deadline > 0, got {self.hypotheses} and {self.deadline}")


NO_OVERLAP = OverlapConfig(enabled=False)


@dataclass
class DraftingStats:
    """What drafting cost one generation, per step of the loop.

    steps         verification steps
    ready_steps   steps whose every row had its draft prepared, and the preparation finished,
                  by the end of the previous forward (the loop did not wait)
    waits         per step, seconds the loop waited for that step's drafts after the forward
    launches      per step, seconds the loop spent starting the next step's speculation
    predicted     row-steps drafted ahead (a foreseen outcome)
    fresh         row-steps answered after the forward (an outcome not foreseen, no overlap, or a
                  step that skipped drafting)
    skipped       steps that drafted nothing without asking: drafting did not pay at that batch
                  size (``worth.DraftingWorth``)
    fallbacks     row-steps drafted without the datastore's sources: its reply late or failed, or
                  its circuit breaker open
    cancelled     datastore calls given up (stale speculation, or past the deadline)
    breaker_open_steps  steps that did not ask the datastore, its circuit breaker open
    probes        calls sent to a datastore whose breaker was open, to see whether it is back
    source_seconds  seconds the steps spent getting their sources: waiting for a datastore's reply (or
                  for the speculation's), or searching an index in process
    """

    steps: int = 0
    ready_steps: int = 0
    waits: list[float] = field(default_factory=list)
    launches: list[float] = field(default_factory=list)
    predicted: int = 0
    fresh: int = 0
    skipped: int = 0
    fallbacks: int = 0
    cancelled: int = 0
    breaker_open_steps: int = 0
    probes: int = 0
    source_seconds: float = 0.0

    def summary(self) -> dict:
        """The figures ``rest-generate --json`` prints: shares, milliseconds, counts."""
        waits, launches = np.asarray(self.waits) * 1e3, np.asarray(self.launches) * 1e3
        rows = self.predicted + self.fresh
        return {
            "steps": self.steps,
            "ready_share": round(self.ready_steps / self.steps, 4) if self.steps else 0.0,
            "predicted_share": round(self.predicted / rows, 4) if rows else 0.0,
            "wait_ms_median": round(float(np.median(waits)), 4) if waits.size else 0.0,
            "wait_ms_p99": round(float(np.percentile(waits, 99)), 4) if waits.size else 0.0,
            "launch_ms_median": round(float(np.median(launches)), 4) if launches.size else 0.0,
            "skipped": self.skipped,
            "fallbacks": self.fallbacks,
            "cancelled": self.cancelled,
            "breaker_open_steps": self.breaker_open_steps,
            "probes": self.probes,
        }


@dataclass(frozen=True)
class _Hypothesis:
    """One foreseen outcome of verifying a row's tree: the accepted ``path`` (tokens), and where
    its source trees are in the speculative call's answer: ``first``, then one per cut of
    ``SUFFIX_CUTS`` shorter than the context (``levels`` in all)."""

    row: int
    path: tuple[int, ...]
    first: int = 0
    levels: int = 0


@dataclass
class _Ahead:
    """Speculation in flight: the rows it was launched for (request, where its context stood),
    their hypotheses, the datastore call and the background job that finishes the trees."""

    rows: list[tuple[Hashable, Mark]]
    hypotheses: list[_Hypothesis]
    shared: Pending
    job: Future


def ahead_config(config: DraftConfig) -> DraftConfig:
    """How a hypothesis context is drafted so that its tree under the bonus token is the tree a
    step would draft after that token, whenever the match extends by it: one level deeper, the
    suffix bounds one token shorter (a match of m tokens plus the bonus is a match of m + 1),
    and room for several bonus tokens' subtrees, each as large as a step's tree."""
    return dataclasses.replace(
        config,
        budget=min(config.budget * AHEAD_WIDTH, MAX_BUDGET),
        max_depth=min(config.max_depth + 1, MAX_DEPTH),
        n_max=max(config.n_max - 1, 1),
        n_min=max(config.n_min - 1, 1),
    )


def likely_outcomes(tree: DraftTree, count: int) -> list[_Hypothesis]:
    """The ``count`` most likely accepted paths of ``tree`` (row 0), the empty path included:
    the path ends at node v with probability score(v) - the sum of its children's scores."""
    ends = np.bincount(tree.parents + 1, weights=tree.scores, minlength=len(tree) + 1)  # children's sum
    chance = np.concatenate(([1.0], tree.scores)) - ends
    hypotheses = []
    for end in np.argsort(-chance, kind="stable")[:count] - 1:  # -1: the root
        nodes = tree.path_to(int(end)) if end >= 0 else np.zeros(0, np.int64)
        hypotheses.append(_Hypothesis(0, tuple(tree.tokens[nodes].tolist())))
    return hypotheses


class DraftScheduler:
    """The decoding loop's drafts, step by step: ``step`` before each forward (or, by parts,
    ``trees`` and ``speculate`` right before it, ``verified`` after it); ``finish`` for requests
    that ended; ``close`` at the end. One per generation (or per engine, for one that names its
    requests and says which ended).

    drafter   a ``StepDrafter`` (``AdaptiveDrafter``: its request source is what a step falls
              back on), any other ``Drafter`` (driven as ``PlainSteps``), or None (no drafts)
    config    the loop's tree size (``budget``, ``max_depth``)
    overlap   see ``OverlapConfig``
    step_seconds  a first estimate of a step's time (the prefill's), until forwards are measured
    cost      what steps are priced by, where not the drafter's (``StepDrafter.cost``): a loop
              without drafts still shapes its blocks by one; the engine's step times feed it here
    """

    def __init__(
        self,
        drafter: Drafter | None,
        config: DraftConfig,
        overlap: OverlapConfig = OverlapConfig(),
        step_seconds: float = 0.1,
        cost: StepCost | None = None,
    ) -> None:
        self.sources = None if drafter is None else steps_for(drafter)
        self._cost = cost
        source = None if self.sources is None else self.sources.source
        self.config, self.overlap = config, overlap
        # the datastore's own breaker where it keeps one across generations, else one for this one
        self.breaker = (source and source.breaker) or CircuitBreaker(f"datastore {type(source).__name__}")
        self.stats = DraftingStats()
        self._forwards: deque[float] = deque([step_seconds], maxlen=16)
        self._worker = (
            ThreadPoolExecutor(1, thread_name_prefix="rest-speculate")
            if overlap.enabled and source is not None and source.reads_suffixes
            else None
        )
        self._ahead: _Ahead | None = None
        self._probe: Pending | None = None  # a probe of the datastore in flight
        self._rows: list[tuple[Hashable, Mark]] = []  # the last ``trees`` call's rows: request, its session's mark
        self._warned = False
        self._late = 0  # speculative calls the background job gave up on
        self.worth = DraftingWorth()  # whether drafting pays at a batch size (weighed with a cost)
        self._live: set[Hashable] = set()  # the last step's requests, less those that ended since
        # the trees the last step handed the engine, and the rows it ran: what its time is observed for
        self._handed: tuple[list[DraftTree], int] | None = None

    @property
    def cost(self) -> StepCost | None:
        """The cost steps are priced by: the one given, else the drafter's. Fed here, from the
        steps the engine times (``verified``)."""
        if self._cost is not None:
            return self._cost
        return None if self.sources is None else self.sources.cost

    def step_seconds(self) -> float:
        """The median of the recent forwards (the prefill's time before the first)."""
        return statistics.median(self._forwards)  # of at most 16: a twentieth of np.median's time

    def _patience(self) -> float:
        """How long a datastore reply may keep the loop waiting: ``deadline`` of a step, at least
        ``MIN_WAIT`` (a fast step must not rule out a healthy datastore's ordinary round trip)."""
        return max(self.step_seconds() * self.overlap.deadline, MIN_WAIT)

    def verified(self, seconds: float, trees: Sequence[DraftTree] | None = None) -> None:
        """The step that verified the trees of the last ``step`` took ``seconds`` (or, where the
        engine verified less than it was handed, ``trees``): the deadlines follow it, and the cost
        learns from it (``StepCost.observe_step``), the same way for every engine."""
        self._forwards.append(seconds)
        cost, handed = self.cost, self._handed
        self._handed = None  # a step is observed once
        if cost is not None and (handed is not None or trees is not None):
            verified = handed[0] if trees is None else list(trees)
            cost.observe_step(verified, seconds, len(verified) if handed is None else handed[1])

    def step(
        self,
        rows: Sequence[Sequence[int]],
        request_ids: Sequence[Hashable] | None = None,
        *,
        batch: int | None = None,
        step_seconds: float | None = None,
        ended: Sequence[Hashable] = (),
        admit: BatchRule | None = None,
        accepted: Sequence[Sequence[int]] | None = None,
        temperatures: Sequence[float] | None = None,
    ) -> list[DraftTree]:
        """One tree per row to verify at the engine's next step (empty trees where the step does
        not draft), given what the engine knows: ``rows``, the live contexts of the rows that may
        draft (read now, not kept; what each gained since the last step is what the verifier
        accepted), named by ``request_ids`` (default: their positions); ``accepted``, per row, the
        tokens the engine committed at its last step, where it reports them (its accepted draft
        tokens and its own: ``StepDrafter.advance``); ``batch``, the rows the
        step runs (default: ``len(rows)``; rows that cannot draft still cost); ``step_seconds``,
        what the step that verified the last call's trees took (None: not timed; else as
        ``verified``); ``ended``, requests that ended since the last step; ``admit``, the engine's
        batch rule (``finish_step``); ``temperatures``, each row's sampling temperature where the
        engine samples some rows (None: all greedy), which the drafter prices its trees by.

        Whether to draft at all is decided here (the module docstring); trees that are drafted are
        then prepared ahead for the next step where overlap is on (``speculate``)."""
        if step_seconds is not None:
            self.verified(step_seconds)
        if ended:
            self.finish(ended)
        size = len(rows) if batch is None else batch
        trees = self._step(rows, request_ids, size, admit, accepted, temperatures)
        self._handed = (trees, size)
        return trees

    def _step(
        self,
        rows: Sequence[Sequence[int]],
        request_ids: Sequence[Hashable] | None,
        size: int,
        admit: BatchRule | None,
        accepted: Sequence[Sequence[int]] | None,
        temperatures: Sequence[float] | None = None,
    ) -> list[DraftTree]:
        if self.sources is None:
            return [DraftTree.empty()] * len(rows)
        if not rows:
            return []
        start = time.perf_counter()
        requests = range(len(rows)) if request_ids is None else request_ids
        self._live = set(requests)
        cost = self.cost
        if cost is not None and not self.worth.drafts(size):
            self._skip(rows, requests, start, accepted, temperatures)
            return [DraftTree.empty()] * len(rows)
        trees = self.trees(rows, requests, admit, accepted, temperatures)
        self.speculate(trees)
        if cost is not None:
            own = time.perf_counter() - start

            def extra(plain: float | None = None) -> float:
                """The step's seconds beyond a plain one (``plain`` seconds, if priced already), by
                the cost as it stands."""
                return cost.step_seconds(trees, size) - (cost.step_seconds([], size) if plain is None else plain) + own

            expected = sum(float(tree.scores.sum()) for tree in trees)
            plain = cost.step_seconds([], size)
            self.worth.weigh(size, expected, extra(plain), plain, reprice=extra)
        return trees

    def _skip(
        self,
        rows: Sequence[Sequence[int]],
        requests: Sequence[Hashable],
        start: float,
        accepted: Sequence[Sequence[int]] | None = None,
        temperatures: Sequence[float] | None = None,
    ) -> None:
        """A step that does not draft: the rows decode on without drafts. The trees recorded for
        them were verified by the step that just ran: ``advance`` credits them, and leaves nothing
        recorded to credit for this step."""
        self.sources.advance(rows, requests, accepted, temperatures)
        self.stats.steps += 1
        self.stats.skipped += 1
        self.stats.fresh += len(rows)
        self.stats.waits.append(time.perf_counter() - start)
        if self._worker is not None:
            self.stats.launches.append(0.0)  # nothing started for the next step

    def trees(
        self,
        contexts: Sequence[Sequence[int]],
        requests: Sequence[Hashable] | None = None,
        admit: BatchRule | None = None,
        accepted: Sequence[Sequence[int]] | None = None,
        temperatures: Sequence[float] | None = None,
    ) -> list[DraftTree]:
        """One tree per live context (read now, not kept), its request named by ``requests``
        (default: the row's position): from the sources fetched ahead where the outcome was
        foreseen, else from sources fetched now; cut by ``admit``, the engine's batch rule."""
        if self.sources is None:
            return [DraftTree.empty()] * len(contexts)
        start = time.perf_counter()
        self._settle_probe()
        requests = range(len(contexts)) if requests is None else requests
        config = self.sources.candidates(self.config)
        ahead, self._ahead = self._ahead, None
        shared: list[SourceTrees | None] = [None] * len(contexts)
        remote_ok, ready = True, ahead is not None and ahead.job.done()
        fetch = time.perf_counter()
        if ahead is not None:
            remote_ok = self._collect(ahead, contexts, requests, shared)
        self.stats.source_seconds += time.perf_counter() - fetch
        sessions = self.sources.advance(contexts, requests, accepted, temperatures)  # the background job is done
        # where each context stands, as its session records it: what speculation drafts ahead from,
        # and checks the next step's outcomes by
        self._rows = [(request, session.mark) for request, session in zip(requests, sessions)] if self._worker else []
        missing = [i for i, trees in enumerate(shared) if trees is None]
        if missing:
            # read within this call, before the engine writes on (a probe's answer only tells the breaker)
            fetch = time.perf_counter()
            fresh = self._fresh([contexts[i] for i in missing], config, remote_ok)
            self.stats.source_seconds += time.perf_counter() - fetch
            for i, trees in zip(missing, fresh):
                shared[i] = trees
        trees = finish_step(self.sources, sessions, shared, config, admit)
        self.stats.steps += 1
        self.stats.ready_steps += ready and not missing
        self.stats.predicted += len(contexts) - len(missing)
        self.stats.fresh += len(missing)
        self.stats.waits.append(time.perf_counter() - start)
        return trees

    def finish(self, requests: Sequence[Hashable]) -> None:
        """These requests ended (the drafter lets their sessions go); once every request of the
        last step has, whether drafting pays is weighed afresh (``DraftingWorth.reset``)."""
        if self.sources is not None:
            self.sources.finish(requests)
        if self._live:
            self._live.difference_update(requests)
            if not self._live:
                self.worth.reset()

    def speculate(self, trees: Sequence[DraftTree]) -> None:
        """Start preparing the next step's drafts for the likely outcomes of verifying ``trees``,
        the last ``trees`` call's answer for its contexts."""
        if self._worker is None:
            return
        start = time.perf_counter()
        if not self.breaker.closed:  # the datastore is not asked; the step after drafts from local sources
            self.stats.launches.append(time.perf_counter() - start)
            return
        config = self.sources.candidates(self.config)
        deeper = ahead_config(config)
        hypotheses, tails = [], []
        for row, tree in enumerate(trees):
            for hypothesis in likely_outcomes(tree, self.overlap.hypotheses):
                tail = [*self._rows[row][1].tail[-deeper.n_max :], *hypothesis.path][
                    -deeper.n_max :
                ]  # all a source reads
                bounds = [len(tail), *(n for n in SUFFIX_CUTS if n < len(tail))]
                hypotheses.append(dataclasses.replace(hypothesis, row=row, first=len(tails), levels=len(bounds)))
                tails += [tail[-n:] for n in bounds]
        deadline = start + self.step_seconds() + self._patience()
        shared = self.sources.start_shared(tails, deeper, timeout=deadline - start)
        job = self._worker.submit(self._wait, shared, deadline)
        self._ahead = _Ahead(self._rows, hypotheses, shared, job)
        self.stats.launches.append(time.perf_counter() - start)

    def close(self) -> None:
        """Cancel speculation and a probe in flight and stop the background thread (a probe's outcome
        stays unknown: the breaker sends another)."""
        if self._ahead is not None:
            self.stats.cancelled += self._ahead.shared.cancel()
            self._ahead = None
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    # ---------------------------------------------------------------------------------- internals

    def _wait(self, shared: Pending, deadline: float) -> list[SourceTrees] | type[CancelledError] | None:
        """Background: the hypotheses' source trees by ``deadline`` (in-process sources are drafted
        here, beside the forward); None when the datastore was late or failed, ``CancelledError``
        when the speculation was cancelled as stale."""
        base, gave_up = self._result(shared, deadline - time.perf_counter())
        self._late += gave_up  # read by the decoding thread once this job is done
        return base

    def _collect(
        self,
        ahead: _Ahead,
        contexts: Sequence[Sequence[int]],
        requests: Sequence[Hashable],
        shared: list[SourceTrees | None],
    ) -> bool:
        """Fill ``shared`` for the rows whose outcome ``ahead`` foresaw, with the hypothesis's
        trees under the bonus token (a row stays None when the index does not continue with it:
        its tree after the token is unknown); returns whether the datastore answered in time (if
        not, those rows draft from local sources, and this step does not ask it again)."""
        outcome: dict[int, tuple[int, int]] = {}  # row -> (hypothesis index, bonus token)
        before = {request: (previous, mark) for previous, (request, mark) in enumerate(ahead.rows)}
        for row, (request, context) in enumerate(zip(requests, contexts)):
            previous, mark = before.get(request, (None, None))
            if mark is None or not mark.continued_by(context) or len(context) == mark.length:
                continue
            appended = mark.gained(context)
            for index, hypothesis in enumerate(ahead.hypotheses):
                if hypothesis.row == previous and hypothesis.path == tuple(appended[:-1]):
                    outcome[row] = (index, appended[-1])
                    break
        if not outcome and ahead.shared.cancel():  # nothing foreseen: stale, stop the server's work
            self.stats.cancelled += 1
        try:
            # a quarter step after the forward at most: the job's own deadline may be later (a
            # forward faster than the median; the first steps', whose estimate is the prefill's)
            fetched = ahead.job.result(timeout=self._patience())
        except FutureTimeoutError:  # late: the call is stopped, and the job with it
            self.stats.cancelled += ahead.shared.cancel()
            fetched = ahead.job.result()
            fetched = None if fetched is CancelledError else fetched
        self.stats.cancelled, self._late = self.stats.cancelled + self._late, 0
        if fetched is CancelledError:
            return True
        self._report(fetched is not None)
        for row, (index, bonus) in outcome.items():
            if fetched is None:
                shared[row] = NO_SOURCES
                self.stats.fallbacks += 1
                continue
            hypothesis = ahead.hypotheses[index]
            levels = fetched[hypothesis.first : hypothesis.first + hypothesis.levels]
            # the longest match the bonus token extends; none at all: the step's own would be empty
            after = next((a for level in levels if (a := level.index.after(bonus)) is not None), None)
            if after is None and not any(len(level.index) for level in levels):
                after = DraftTree.empty()
            if after is not None:
                shared[row] = SourceTrees(after, levels[0].outputs.after(bonus) or DraftTree.empty())
        return fetched is not None

    def _fresh(self, rows: list[list[int]], config: DraftConfig, remote_ok: bool) -> list[SourceTrees]:
        """Source trees fetched now for ``rows``, the datastore given ``deadline`` of a step to
        answer (not asked when it just failed to, nor while its breaker is open: then maybe probed)."""
        admission = self.breaker.admit() if remote_ok else Admission.SKIP
        if admission is Admission.CALL:
            timeout = self._patience()
            shared = self.sources.start_shared(rows, config, timeout=timeout)
            base, gave_up = self._result(shared, timeout)
            self.stats.cancelled += gave_up
            if base is not CancelledError:
                self._report(base is not None)
            if base is not None and base is not CancelledError:
                return base
        elif remote_ok:
            self.stats.breaker_open_steps += 1
            if admission is Admission.PROBE:
                # asked as a step would ask, but not waited for: a later step reads the outcome
                self._probe = self.sources.start_shared(rows, config, timeout=self._patience())
                self.stats.probes += 1
        self.stats.fallbacks += len(rows)
        return [NO_SOURCES] * len(rows)

    def _report(self, answered: bool) -> None:
        """Tell the breaker whether a datastore call was answered in time."""
        if answered:
            self.breaker.succeeded()
        else:
            self.breaker.failed()

    def _settle_probe(self) -> None:
        """Report the probe's outcome to the breaker once it has one (never waiting for it)."""
        if self._probe is None:
            return
        try:
            self._probe.result(timeout=0)
        except TimeoutError:  # still in flight (its deadline ends it)
            return
        except CancelledError:
            pass
        except DATASTORE_FAILURES as exc:
            log.debug("probe of the datastore failed: %s", exc)
            self.breaker.failed()
        else:
            self.breaker.succeeded()
        self._probe = None

    def _result(self, shared: Pending, timeout: float) -> tuple[object, bool]:
        """The datastore's answer -- None when it was late or failed, the ``CancelledError``
        class when it was cancelled -- and whether it was given up on here (late: cancelled)."""
        try:
            return shared.result(timeout=max(timeout, 0.0)), False
        except CancelledError:
            return CancelledError, False
        except DATASTORE_FAILURES as exc:
            gave_up = isinstance(exc, TimeoutError) and shared.cancel()
            if not self._warned:
                log.warning("drafting from local sources only: %s", exc)
                self._warned = True
            else:
                log.debug("drafting from local sources only: %s", exc)
            return None, gave_up
