"""Drafters replayed in a fleet on vLLM's greedy outputs, without the engine (``run_fleet``): replicas
that have served a warm-up draft held-out requests a chain a step, the longest prefix the output
follows accepted plus one token, as vLLM's verifier does. ``suffix`` (Arctic Inference's cache per
replica, ``SuffixReplay``) against REST's proposer (one shared store of outputs, ``RestReplay``),
tallied in tokens a step (``Tally``), with what their chains claimed (``Claims``) and REST's hindsight
per source (``hindsight_per_source``). ``benchmarks.history`` and ``benchmarks.code_scale`` run it;
``benchmarks.fleet`` reports the same hindsight of real engines."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness.replay import Example
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.calibration_memory import CalibrationMemory
from rest_spec.drafter.core.cost import CostKey, VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.merge import MATCH_LENGTH_EDGES, Attribution, MergedTree, length_class
from rest_spec.drafter.core.selection import select_batch_chains
from rest_spec.drafter.core.steps import draft_step

REST_SOURCES = {
    "rest": ("index", "request", "outputs", "suffix"),
    "rest-no-suffix": ("index", "request", "outputs"),
    "rest-index-suffix": ("index", "suffix"),
    "rest-no-request": ("index", "outputs", "suffix"),
    "rest-no-outputs": ("index", "request", "suffix"),
    "rest-raw": ("index", "request", "outputs", "suffix"),
    "rest-own": ("index", "request", "outputs", "suffix"),
    "rest-no-index": ("request", "outputs"),
    "rest-outputs": ("outputs",),
}


def hindsight_per_source(cells: list[dict]) -> dict:
    """``Attribution.report``'s cells summed over match lengths, per source: steps it offered a
    first token of the merged tree (``offered``), tokens of what followed its part held (``held``,
    per offer), steps it proposed a first token of the verified tree (``steps``) and the tokens of it
    accepted (``accepted``, per step)."""
    out: dict[str, dict] = {}
    for cell in cells:
        total = out.setdefault(cell["source"], dict.fromkeys(("offered", "held", "steps", "accepted", "verified"), 0))
        for key in total:
            total[key] += cell[key]
    for total in out.values():
        total["held_per_offer"] = total["held"] / total["offered"] if total["offered"] else None
        total["accepted_per_step"] = total["accepted"] / total["steps"] if total["steps"] else None
    return out


def match_cell(length: int) -> str:
    """The match-length class of ``length`` as its range (``drafter.core.merge.MATCH_LENGTH_EDGES``)."""
    c = int(length_class([length])[0])
    low = MATCH_LENGTH_EDGES[c]
    return f"{low}-{MATCH_LENGTH_EDGES[c + 1] - 1}" if c + 1 < len(MATCH_LENGTH_EDGES) else f"{low}+"


class Claims:
    """What a drafter's chains claimed (the sum of their scores: the tokens it expects accepted)
    beside what they got accepted, per cell (a chain's leading source and match length; one cell
    for ``suffix``): whether a drafter's chains are priced as surer than they are."""

    def __init__(self) -> None:
        self.cells: dict[str, list[float]] = {}  # cell -> [claimed, accepted, chains]
        self._held: tuple[str, float] | None = None

    def hold(self, cell: str, claimed: float) -> None:
        """A chain claiming ``claimed`` tokens was drafted; ``credit`` says what it got."""
        self._held = (cell, claimed)

    @property
    def holding(self) -> str | None:
        """The cell of the chain drafted and not credited yet (None: none)."""
        return None if self._held is None else self._held[0]

    def drop(self) -> None:
        """Forget the chain held: it was not verified."""
        self._held = None

    def credit(self, accepted: int) -> None:
        if self._held is not None:
            cell, claimed = self._held
            figures = self.cells.setdefault(cell, [0.0, 0.0, 0])
            figures[0] += claimed
            figures[1] += accepted
            figures[2] += 1
            self._held = None

    def merge(self, other: Claims) -> None:
        for cell, figures in other.cells.items():
            mine = self.cells.setdefault(cell, [0.0, 0.0, 0])
            for i, value in enumerate(figures):
                mine[i] += value

    def report(self) -> dict:
        """Claimed over accepted, overall and per cell (with each cell's chains)."""
        claimed = sum(figures[0] for figures in self.cells.values())
        accepted = sum(figures[1] for figures in self.cells.values())
        return {
            "claimed_over_accepted": round(claimed / accepted, 4) if accepted else None,
            "by_cell": {
                cell: {
                    "claimed_over_accepted": round(figures[0] / figures[1], 4) if figures[1] else None,
                    "chains": int(figures[2]),
                    "accepted": int(figures[1]),
                }
                for cell, figures in sorted(self.cells.items())
            },
        }


class SuffixReplay:
    """A replica's vLLM ``suffix`` proposer around Arctic Inference's cache, fed the same way."""

    def __init__(self, k: int) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.k, self.cache, self.depth = k, SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000), 24
        self.claims = Claims()

    def serve(self, rid: str, prompt: list[int], output: list[int]) -> None:
        self.cache.start_request(rid, np.asarray(prompt, dtype=np.int32))
        self.cache.add_active_response(rid, output)
        self.cache.stop_request(rid)

    def start(self, rid: str, prompt: list[int]) -> None:
        self.cache.start_request(rid, np.asarray(prompt, dtype=np.int32))

    def draft(self, rid: str, context: list[int], sampled: list[int]) -> list[int]:
        self.cache.add_active_response(rid, sampled)
        pattern = np.asarray(context[-self.depth :], dtype=np.int32)
        draft = self.cache.speculate(rid, pattern, max_spec_tokens=self.k, max_spec_factor=1.0, min_token_prob=0.1)
        if draft.token_ids:
            self.claims.hold("suffix", float(draft.score))
        return list(draft.token_ids)

    def credit(self, accepted: int, following: Sequence[int]) -> None:
        self.claims.credit(accepted)

    def finish(self, rid: str, output: list[int]) -> None:
        self.cache.stop_request(rid)


class PricedStep:
    """A step of ``rows`` rows verifying ``drafted`` draft tokens costs rows + ``price`` x drafted
    plain one-row steps: ``BatchCost``'s shape with a fixed price, for the batch admission."""

    def __init__(self, price: float) -> None:
        self.price = price

    def seconds(self, rows: int, drafted: int | np.ndarray) -> np.ndarray:
        return rows + self.price * np.asarray(drafted, np.float64)


def suffix_replica(k: int, served: list[Example]) -> SuffixReplay:
    """A suffix replica that has served ``served`` (prompt, output) requests."""
    suffix = SuffixReplay(k)
    for i, (prompt, output) in enumerate(served):
        suffix.serve(f"warm-{i}", prompt, output)
    return suffix


class RestReplay:
    """A replica's REST proposer: the adaptive drafter vLLM's proposer runs (``sources``) over
    ``base`` (the index and the fleet's one store of outputs), choosing the chain of most expected
    tokens per step time, at most k long, a draft token costing ``price`` of a plain step (0: flat,
    the chain of most expected tokens), then admitted as vLLM's proposer admits it
    (``select_batch_chains`` at one row), its scores calibrated on the chains verified unless
    ``calibrate`` is off (``rest-raw``). Keeps what the admitted chains' scores claimed beside
    what they got accepted, overall and by the leading source and match length of their first
    token (``claims``)."""

    def __init__(
        self,
        k: int,
        base: LocalDrafter,
        sources: Sequence[str],
        price: float = 0.0,
        calibrate: bool = True,
        memory: CalibrationMemory | None = None,
    ) -> None:
        seconds = tuple(1.0 + price * n for n in range(k + 1))
        priced = VerifyCost(CostKey("priced", "", 1, "cpu", "float32"), 256, tuple(range(1, k + 2)), seconds)
        self.k, self.base, self.sources, self.step = k, base, tuple(sources), PricedStep(price)
        self.adaptive = AdaptiveDrafter(
            base, cost=priced, sources=sources, chains=True, calibrate_chains=calibrate, memory=memory
        )
        self.claims = Claims()

    def serve(self, rid: str, prompt: list[int], output: list[int]) -> None:
        self.base.add_output(output)

    def start(self, rid: str, prompt: list[int]) -> None:
        pass

    def draft(self, rid: str, context: list[int], sampled: list[int]) -> list[int]:
        [chain] = draft_step(
            self.adaptive,
            [context],
            DraftConfig(max_depth=self.k),
            [rid],
            admit=lambda chains: select_batch_chains(chains, self.step, 1),
        )
        if len(chain):
            leading = int(np.argmax(chain.source_probs[0])) if isinstance(chain, MergedTree) else 0
            length = int(chain.source_match_len[leading]) if isinstance(chain, MergedTree) else chain.match_len
            self.claims.hold(f"{self.sources[leading]}, match {match_cell(length)}", float(chain.scores.sum()))
        return [int(t) for t in chain.tokens]  # a chain's nodes are in depth order

    def credit(self, accepted: int, following: Sequence[int]) -> None:
        self.claims.credit(accepted)

    def finish(self, rid: str, output: list[int]) -> None:
        self.adaptive.finish([rid])
        self.base.add_output(output)


class Shadowed:
    """A REST replica with suffix's replica beside it on the same requests (``--versus-suffix``):
    each step both draft from the same context, REST's chain is verified, and suffix's is set
    against it (the tokens each would have got accepted there): whether REST's chain holds at least
    what suffix's holds on every step, and where not, which of REST's sources led its chain."""

    def __init__(self, rest: RestReplay, suffix: SuffixReplay) -> None:
        self.rest, self.suffix = rest, suffix
        self.claims = rest.claims
        self.steps: dict[str, list[int]] = {}  # REST's leading source -> [steps, at least, short, tokens short]
        self._chains: tuple[list[int], list[int], str] | None = None

    def start(self, rid: str, prompt: list[int]) -> None:
        self.rest.start(rid, prompt)
        self.suffix.start(rid, prompt)

    def draft(self, rid: str, context: list[int], sampled: list[int]) -> list[int]:
        chain = self.rest.draft(rid, context, sampled)
        theirs = self.suffix.draft(rid, context, sampled)
        self._chains = (chain, theirs, (self.rest.claims.holding or "none").split(",")[0])
        return chain

    def credit(self, accepted: int, following: Sequence[int]) -> None:
        self.rest.credit(accepted, following)
        self.suffix.claims.drop()  # suffix's chain is not verified here: its claim is not counted
        if self._chains is not None:
            _, theirs, source = self._chains
            cell = self.steps.setdefault(source, [0, 0, 0, 0])
            short = accepted_length(theirs, following) - accepted
            cell[0] += 1
            cell[1] += short <= 0
            cell[2] += short > 0
            cell[3] += max(short, 0)
            self._chains = None

    def finish(self, rid: str, output: list[int]) -> None:
        self.rest.finish(rid, output)
        self.suffix.finish(rid, output)


def versus_suffix(shadows: Sequence[Shadowed]) -> dict:
    """The replicas' steps set against suffix's chains: the share where REST's chain held at least
    as much, and per source that led REST's chain the steps where suffix's held more and the tokens
    it held beyond REST's."""
    cells: dict[str, list[int]] = {}
    for shadow in shadows:
        for source, counts in shadow.steps.items():
            mine = cells.setdefault(source, [0, 0, 0, 0])
            for i, value in enumerate(counts):
                mine[i] += value
    steps = sum(c[0] for c in cells.values())
    return {
        "steps": steps,
        "at_least_suffix": round(sum(c[1] for c in cells.values()) / steps, 4) if steps else None,
        "tokens_short_per_step": round(sum(c[3] for c in cells.values()) / steps, 4) if steps else None,
        "by_rest_source": {
            source: {"steps": c[0], "suffix_held_more": c[2], "tokens_short": c[3]}
            for source, c in sorted(cells.items())
        },
    }


@dataclasses.dataclass
class Tally:
    """Steps, tokens and draft tokens over every replica's held-out requests."""

    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    per_prompt: list[float] = dataclasses.field(default_factory=list)

    def figures(self, price: float = 0.0) -> dict:
        """Tokens per step, and the speed against plain of a step that costs 1 + ``price`` per
        draft token (a plain step: 1): the engine's throughput where a draft token costs that
        share of a row's plain step, drafting's own time left out."""
        return {
            "steps": self.steps,
            "modeled_speed_vs_plain": round(self.tokens / (self.steps + price * self.drafted), 4),
            "tokens_per_step": round(self.tokens / self.steps, 4),
            "tokens_per_step_median": round(statistics.median(self.per_prompt), 4),
            "accepted_per_step": round(self.accepted / self.steps, 4),
            "drafted_per_step": round(self.drafted / self.steps, 4),
        }


def accepted_length(chain: Sequence[int], following: Sequence[int]) -> int:
    n = 0
    for drafted, actual in zip(chain, following):
        if drafted != actual:
            break
        n += 1
    return n


def replay(drafter, held_out: list[tuple[int | str, Example]], tally: Tally) -> None:
    """Each of ``held_out`` (number or name, (prompt, greedy output)) served one at a time by ``drafter``:
    at each step its chain's longest prefix the output follows is accepted, plus one token."""
    for number, (prompt, output) in held_out:
        rid, context, position, steps = number if isinstance(number, str) else f"held-{number}", list(prompt), 0, 0
        drafter.start(rid, prompt)
        sampled: list[int] = []
        while position < len(output):
            chain = drafter.draft(rid, context, sampled) if position else []  # the first token is the prefill's
            n = accepted_length(chain, output[position:])
            drafter.credit(n, output[position:])
            take = min(n + 1, len(output) - position)
            sampled = output[position : position + take]
            context += sampled
            position += take
            steps += 1
            tally.drafted, tally.accepted = tally.drafted + len(chain), tally.accepted + n
        tally.steps, tally.tokens = tally.steps + steps, tally.tokens + len(output)
        tally.per_prompt.append(len(output) / steps)
        drafter.finish(rid, output)


def run_fleet(
    name: str,
    k: int,
    index: Path | list[Path],
    warm: list[Example],
    held_out: list[Example],
    replicas: int,
    price: float = 0.0,
    shadow: bool = False,
    restart: bool = False,
    forget: bool = False,
) -> dict:
    """Drafter ``name`` in a fleet of ``replicas``, each having served its share (round-robin) of
    ``warm``, then its share of ``held_out``, one replica after another: suffix's replicas keep a
    cache each; REST's share the index and one store of outputs (each warm-up output once served,
    and each held-out output), each with a proposer (calibrations, sessions, suffix source) of its
    own that drafted its share of the warm-up in the fleet's order (not tallied): what a replica
    that served them learned. ``index``:
    one index directory or several opened as one. With ``shadow``, each REST replica has suffix's
    replica beside it (``Shadowed``), reported as ``versus_suffix``. With ``restart``, every engine
    restarted after the warm-up: suffix's cache starts empty; REST's durable store of outputs is
    reloaded whole (its suffix source replays it), and each REST replica recalls the calibrations it
    kept (``CalibrationMemory``; with ``forget``, they start empty too). A replica with no
    held-out request in its share (more replicas than held-out prompts) is not replayed: what it
    served is only in the store."""
    tally, claims = Tally(), Claims()
    numbered = list(enumerate(held_out))
    served = [[] if restart else warm[r::replicas] for r in range(replicas)]  # suffix's replicas' caches
    serving = [r for r in range(replicas) if numbered[r::replicas]]
    if name == "suffix":
        for r in serving:
            suffix = suffix_replica(k, served[r])
            replay(suffix, numbered[r::replicas], tally)
            claims.merge(suffix.claims)
        return {**tally.figures(price), "claims": claims.report()}
    base = LocalDrafter.open(index, outputs_max_tokens=50_000_000)
    try:
        sources, calibrate = REST_SOURCES[name], name != "rest-raw"
        rests = {r: RestReplay(k, base, sources, price, calibrate) for r in serving}
        for number, example in enumerate(warm):
            if (restart and forget) or number % replicas not in rests:  # only the store keeps what it served
                base.add_output(example[1])
            else:
                replay(rests[number % replicas], [(f"warm-{number}", example)], Tally())
        if restart:  # each replica keeps what it learned, a new process in its place recalls it
            with tempfile.TemporaryDirectory() as kept:
                for r, rest in rests.items():
                    rest.adaptive.memory = CalibrationMemory(Path(kept) / f"replica-{r}.npz")
                    rest.adaptive.remember()
                    rests[r] = RestReplay(k, base, sources, price, calibrate, memory=rest.adaptive.memory)
        attribution, shadows = Attribution(REST_SOURCES[name]), []
        for r in serving:
            rest = rests[r]
            rest.claims = Claims()  # what the held-out chains claimed and got, only
            before = {count: getattr(rest.adaptive.attribution, count).copy() for count in Attribution.COUNTS}
            if shadow:
                shadows.append(Shadowed(rest, suffix_replica(k, served[r])))
            replay(shadows[-1] if shadow else rest, numbered[r::replicas], tally)
            claims.merge(rest.claims)
            for count in Attribution.COUNTS:
                getattr(attribution, count)[...] += getattr(rest.adaptive.attribution, count) - before[count]
    finally:
        base.close()
    cells = attribution.report()
    return {
        **tally.figures(price),
        "claims": claims.report(),
        **({"versus_suffix": versus_suffix(shadows)} if shadow else {}),
        "hindsight": attribution.hindsight(),
        "by_source": hindsight_per_source(cells),
        "attribution": cells,
    }
