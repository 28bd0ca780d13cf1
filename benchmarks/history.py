"""What a deployment's past outputs are worth to each drafter, replayed without the engine.

    .venv-vllm/bin/python -m benchmarks.history --sets code --prompts 64 --warmup 0,500,2000 --replicas 1,4

A replica that has served N earlier requests drafts the held-out requests that follow. Greedy
outputs do not depend on the drafter, so the model runs once (plain vLLM, many requests at a time;
cached under ``$REST_CACHE_DIR/greedy-vllm``) and every drafter is replayed on the same outputs:
at each step it drafts a chain of at most ``--k`` tokens from the context so far, the longest prefix
the greedy output follows is accepted plus one token, as vLLM's verifier does. No timing: tokens
per step only, so the comparison is exact and free of this machine's noise.

Drafters, each starting from the same history (the warm-up requests' prompts and outputs, served in
order, then each held-out request's output once it finished):

- ``suffix``: Arctic Inference's ``SuffixDecodingCache`` with vLLM's ``suffix`` settings (tree depth
  24, at most k tokens, spec factor 1, min token probability 0.1), fed as vLLM's proposer feeds it;
- ``rest``: the adaptive drafter vLLM's proposer runs (index, the request's own text and the store
  of outputs, merged and scored), its chain the root path of most expected tokens per step priced
  by ``--price``, admitted as the proposer admits it (``select_batch_chains``) on scores calibrated
  by the chains verified before (``drafter.core.chain_calibration``);
- ``rest-no-suffix``: ``rest`` without vLLM's ``suffix`` matcher among its sources, as before
  2026-12-06 (``rest`` has it, as vLLM's proposer does where Arctic Inference is installed:
  ``drafter.core.suffix_cache``, its cache of responses fed from the fleet's store of outputs);
- ``rest-no-index``: the same without the index (the request and the store only: suffix's sources);
- ``rest-outputs``: the store of outputs alone;
- ``rest-raw``: ``rest`` with its chains scored by the merge alone (no ``ChainCalibration``), as
  before 2026-12-06: what the calibration of the chains changes;
- ``rest-own``: ``rest`` with the model's own corpus (``--own-index``, built by
  ``benchmarks.own_corpus``) opened with the set's index as one.

Sets and warm-up streams are ``benchmarks.fleet``'s: ``code`` holds out HumanEval from the 101st
problem, its warm-up function-completion prompts mined from packages no index holds; ``chat`` holds
out ShareGPT 41-80 (first user turns of the sharegpt index's held-out conversations), its warm-up
the held-out conversations from the 81st on, then conversations inside the index. F replicas
(``--replicas``) each serve their round-robin share, REST's replicas drafting theirs (not tallied);
past the held-out prompts' number a fleet is simulated (each replica's caches hold 1/F of the
warm-up's outputs, and only the replicas given a held-out prompt are replayed). ``--restart``
replays each warmed fleet again as if every engine had restarted after the warm-up: suffix's
caches empty; REST's durable store of outputs reloaded (its suffix source's responses replayed from
it) and each replica's calibrations recalled from the file it kept
(``drafter.core.calibration_memory``); ``--restart-forgets``: as before 17ad635, REST's
calibrations empty too. Reports, per set, F and warm-up size N, tokens per step and accepted tokens
per step of each drafter, their lift over no history, what their chains claimed against what they
got accepted (``claims``: the sum of a chain's scores over its accepted tokens, per leading source and match length; suffix's
``score``), and for the REST drafters their attribution in hindsight per source
(``drafter.core.merge.Attribution``: tokens each source held of what followed, tokens accepted).

``--price p`` prices a draft token at p of a row's plain step (vLLM on this CPU: about 0.04 at one
row, 0.5 at 16): REST's chains are sized by it, and every drafter's speed against plain is modeled as
tokens / (steps + p x draft tokens), drafting's own time left out -- what a drafter's chains can
reach under load, without the noise of timed runs.

``--versus-suffix`` replays suffix beside each REST replica on the same contexts: at every step both
draft, REST's chain is verified, and suffix's is set against it (``versus_suffix``: the share of steps
where REST's chain held at least what suffix's held, the tokens short a step, and per source that
led REST's chain the steps where suffix's held more).

``--tune M`` replays a tuning split instead, so the drafting core's choices are made without the
held-out sets: the held-out requests are the last M of the warm-up stream (drawn max(N) + M long,
their outputs cached with the warm-up's) and the warm-up the requests before them. It never decodes:
an output not cached already is an error (``max(N) + M`` within the 2,000 cached per set).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import (
    add_fleet_arguments,
    add_own_index_argument,
    benchmark_parser,
    comma_list,
    ensure_index,
    positive_int,
    report_header,
    require_own_index,
    save_report,
)
from benchmarks.e2e import INDEXES, set_prompts
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.calibration_memory import CalibrationMemory
from rest_spec.drafter.core.cost import CostKey, VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.merge import MATCH_LENGTH_EDGES, Attribution, MergedTree, length_class
from rest_spec.drafter.core.selection import select_batch_chains
from rest_spec.drafter.core.steps import draft_step

log = logging.getLogger("benchmarks.history")
SETS = ("code", "chat")  # benchmarks.fleet's streams
RESULTS = Path(__file__).resolve().parent / "results"
DRAFTERS = ("suffix", "rest", "rest-no-suffix", "rest-no-index", "rest-outputs", "rest-own", "rest-raw")
REST_SOURCES = {
    "rest": ("index", "request", "outputs", "suffix"),
    "rest-no-suffix": ("index", "request", "outputs"),
    "rest-raw": ("index", "request", "outputs", "suffix"),
    "rest-own": ("index", "request", "outputs", "suffix"),
    "rest-no-index": ("request", "outputs"),
    "rest-outputs": ("outputs",),
}
Example = tuple[list[int], list[int]]  # prompt, greedy output


# ---- prompts and the model's outputs ----------------------------------------------------------------


def set_streams(name: str, tokenizer, warmup: int, prompts: int) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(index, warm-up prompts, held-out prompts) of set ``name``, as ``benchmarks.fleet`` draws
    them: never the same prompt in both."""
    from benchmarks.fleet import CHAT_WARMUP_AFTER, STREAMS, chat_warmup_prompts, code_warmup_prompts

    stream = STREAMS[name]
    index = ensure_index(*INDEXES[stream.set])
    held = set_prompts(stream.set, tokenizer, index, prompts, 1024, stream.skip)
    if name == "code":
        warm, _ = code_warmup_prompts(tokenizer, warmup, held)
    else:
        warm, _ = chat_warmup_prompts(
            tokenizer, index, warmup, max(CHAT_WARMUP_AFTER, stream.skip + prompts), 1024, held
        )
    return index, warm, held


def greedy_outputs(prompts: list[list[int]], args: argparse.Namespace, *, cached_only: bool = False) -> list[list[int]]:
    """Plain vLLM's greedy outputs of ``prompts``, decoded once and cached per prompt with
    ``benchmarks.fleet``'s warm-up outputs (the fleet benchmark reuses them); with ``cached_only``
    (``--tune``) an output not cached is an error, not decoded."""
    from benchmarks.fleet import prompt_key, warmup_cache, warmup_outputs

    if cached_only and prompts:
        path = warmup_cache(args.max_new_tokens)
        cached = json.loads(path.read_text())["outputs"] if path.is_file() else {}
        missing = sum(prompt_key(p) not in cached for p in prompts)
        if missing:
            raise SystemExit(f"--tune decodes nothing: {missing} of {len(prompts)} outputs are not in {path}")
    return warmup_outputs(prompts, args)[0] if prompts else []


def tuning_split(warm: list[list[int]], tune: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up, held-out) of ``--tune``: the last ``tune`` requests of the warm-up stream held out."""
    if not 0 < tune <= len(warm):
        raise ValueError(f"--tune {tune} needs a warm-up stream of at least that many requests, got {len(warm)}")
    return warm[:-tune], warm[-tune:]


# ---- the drafters, replayed ---------------------------------------------------------------------------


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
    from benchmarks.fleet import hindsight_per_source

    cells = attribution.report()
    return {
        **tally.figures(price),
        "claims": claims.report(),
        **({"versus_suffix": versus_suffix(shadows)} if shadow else {}),
        "hindsight": attribution.hindsight(),
        "by_source": hindsight_per_source(cells),
        "attribution": cells,
    }


# ---- the run -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, prompts_help="held-out prompts per set", sets=SETS)
    add_fleet_arguments(p)
    p.add_argument("--k", type=positive_int, default=8, help="draft tokens per step at most (default: %(default)s)")
    p.add_argument(
        "--price",
        type=float,
        default=0.0,
        help="a draft token's cost as a share of a row's plain step: REST's chains are sized by it, and every "
        "drafter's modeled speed priced by it (vLLM on this CPU: about 0.05 at 1 row, 0.5 at 16; "
        "default: %(default)s, flat)",
    )
    p.add_argument("--warmup-concurrency", type=positive_int, default=32, help="requests at once decoding outputs")
    p.add_argument(
        "--drafters",
        type=comma_list(DRAFTERS),
        default=",".join(DRAFTERS[:-1]),
        help=f"comma-separated, of {','.join(DRAFTERS)} (default: %(default)s)",
    )
    add_own_index_argument(p, SETS, "the rest-own drafter")
    p.add_argument(
        "--tune",
        type=int,
        default=0,
        metavar="M",
        help="hold out the last M warm-up requests instead of the set's held-out prompts (a tuning split)",
    )
    p.add_argument(
        "--versus-suffix",
        action="store_true",
        help="replay suffix beside each REST replica on the same contexts: the share of steps where REST's chain "
        "held at least what suffix's held, and where not, which source led REST's chain",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="also replay each fleet with N > 0 after a restart of every engine: suffix's caches start empty, "
        "REST reloads its durable store of outputs and recalls its calibrations (reported as 'F=.. N=.. restart')",
    )
    p.add_argument(
        "--restart-forgets",
        action="store_true",
        help="with --restart: REST's calibrations start empty too, as before they were kept (17ad635)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "history.json")
    args = p.parse_args(argv)
    require_own_index(p, args, "rest-own", args.drafters)
    args.warmup, args.replicas = sorted(args.warmup), sorted(args.replicas)
    if args.price < 0:
        p.error("--price must be >= 0")
    if min(args.warmup) < 0 or min(args.replicas) < 1:
        p.error("--warmup >= 0, --replicas >= 1")
    if args.tune < 0 or 0 < args.tune < max(args.replicas):
        p.error("--tune M: M at least the largest --replicas")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from benchmarks.vllm import ENGINE_MODEL
    from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

    ENGINE_MODEL.update(model=str(hf_checkpoint(None, dtype="float32")), dtype="float32")  # as benchmarks.fleet
    tokenizer = load_tokenizer(None)
    report = report_header("history", argv)
    report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["config"]["own_index"] = {name: str(path) for name, path in args.own_index.items()}
    report["sets"] = {}
    for name in args.sets:
        index, warm_prompts, held_prompts = set_streams(name, tokenizer, max(args.warmup) + args.tune, args.prompts)
        if args.tune:
            warm_prompts, held_prompts = tuning_split(warm_prompts, args.tune)
        held_out = list(zip(held_prompts, greedy_outputs(held_prompts, args, cached_only=bool(args.tune))))
        result = report["sets"][name] = {"index": str(index), "held_out": len(held_out), "fleets": {}}
        if args.tune:
            result["tuning_split"] = f"warm-up requests {max(args.warmup) + 1}-{max(args.warmup) + args.tune} held out"
        if name in args.own_index:
            result["own_index"] = str(args.own_index[name])
        for n in args.warmup:  # the warm-up decoded as far as each N needs, so the small N report first
            warm = list(zip(warm_prompts[:n], greedy_outputs(warm_prompts[:n], args, cached_only=bool(args.tune))))
            restarts = (False, True) if args.restart and n > 0 else (False,)
            for f, restart in itertools.product(args.replicas, restarts):
                row = {
                    d: run_fleet(
                        d,
                        args.k,
                        [index, args.own_index[name]] if d == "rest-own" else index,
                        warm,
                        held_out,
                        f,
                        args.price,
                        shadow=args.versus_suffix and d != "suffix",
                        restart=restart,
                        forget=args.restart_forgets,
                    )
                    for d in args.drafters
                }
                cold = result["fleets"].get(f"F={f} N={args.warmup[0]}", row)
                for d, figures in row.items():
                    figures["lift_over_cold"] = round(figures["tokens_per_step"] / cold[d]["tokens_per_step"], 4)
                label = f"F={f} N={n}" + (" restart" if restart else "")
                result["fleets"][label] = row
                line = ", ".join(
                    f"{d} {r['tokens_per_step']:.3f} ({r['modeled_speed_vs_plain']:.3f}x"
                    + (
                        f"; >= suffix on {r['versus_suffix']['at_least_suffix']:.1%} of steps"
                        if "versus_suffix" in r
                        else ""
                    )
                    + ")"
                    for d, r in row.items()
                )
                print(f"{name} {label}: tokens/step (modeled speed at price {args.price}) {line}", file=sys.stderr)
                save_report(report, args.out, echo=False)  # what is measured so far, should a later N fail
    save_report(report, args.out)


if __name__ == "__main__":
    main()
