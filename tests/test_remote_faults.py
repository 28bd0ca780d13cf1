"""A datastore that dies or freezes mid-generation (issue 24): the circuit breaker's state machine
(``drafter.core.breaker``, on an injected clock), then real processes -- a ``rest-datastore serve``
subprocess frozen with SIGSTOP and resumed with SIGCONT, or killed with SIGKILL and started again on
its port -- under the decoding loop's scheduler, under generation with SmolLM2, and under the
``rest-generate`` CLI: the generation completes with plain decoding's output, the breaker opens
(the steps stop asking the datastore), and drafting resumes within about a second of the server
being back."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from benchmarks.harness.sets import humaneval_prompts
from rest_spec.common.tokenizer import tokenizer_fingerprint
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.breaker import Admission, BreakerState, CircuitBreaker
from rest_spec.drafter.core.cost import CostKey, VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.core.scheduler import DraftScheduler, OverlapConfig
from rest_spec.drafter.core.uploads import OutputUploader, UploadStats
from rest_spec.drafter.hf.generate import generate
from tests.helpers import CORPUS_VOCAB, ONE_THREAD, TIME_SCALE, DatastoreProcess, synthetic_corpus, write_index

ROOT = Path(__file__).resolve().parents[1]
# "back within about a second": the breaker probes at most every 0.5 s and gRPC reconnects within
# 0.25 s; the rest is room for a busy machine, whose steps take several times as long and whose
# datastore answers a probe later than the quarter step it is given (TIME_SCALE: CI's load)
RECOVERY_BOUND = 3.0 * TIME_SCALE


# ---- the breaker's state machine ---------------------------------------------------------------


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock) -> CircuitBreaker:
    return CircuitBreaker("datastore at test", failures=3, backoff=0.1, max_backoff=0.5, clock=clock)


def test_the_breaker_opens_after_consecutive_failures_only():
    clock = Clock()
    b = breaker(clock)
    for _ in range(5):  # failures with an answer between them never add up
        b.failed()
        b.failed()
        b.succeeded()
    assert b.state is BreakerState.CLOSED and b.admit() is Admission.CALL
    b.failed(), b.failed(), b.failed()
    assert b.state is BreakerState.OPEN and b.openings == 1
    assert b.admit() is Admission.SKIP and not b.closed
    b.failed()  # a call admitted before it opened, failing late: it stays open, no longer
    clock.now += 0.1
    assert b.admit() is Admission.PROBE


def test_an_open_breaker_probes_once_per_backoff_doubling_up_to_its_cap():
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.failed()
    waits = []
    for _ in range(6):
        opened = clock.now
        while (admission := b.admit()) is Admission.SKIP:
            clock.now = round(clock.now + 0.01, 2)
        assert admission is Admission.PROBE and b.state is BreakerState.HALF_OPEN
        waits.append(round(clock.now - opened, 2))
        assert b.admit() is Admission.SKIP  # one probe at a time
        b.failed()
    assert waits == [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    assert b.probes == 6 and b.openings == 1


def test_an_answered_probe_closes_the_breaker_and_resets_its_backoff():
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.failed()
    for _ in range(3):  # probes fail until the backoff is at its cap
        clock.now += 1
        assert b.admit() is Admission.PROBE
        b.failed()
    clock.now += 1
    assert b.admit() is Admission.PROBE
    b.succeeded()
    assert b.state is BreakerState.CLOSED and b.admit() is Admission.CALL
    for _ in range(3):
        b.failed()
    assert b.openings == 2
    clock.now += 0.1  # the first backoff again, not the cap
    assert b.admit() is Admission.PROBE


def test_a_probe_whose_outcome_never_comes_is_followed_by_another():
    """A generation that ends with a probe in flight cancels it unreported: the breaker must not
    wait for it forever."""
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.failed()
    clock.now += 0.1
    assert b.admit() is Admission.PROBE
    clock.now += 0.05
    assert b.admit() is Admission.SKIP
    clock.now += 0.05
    assert b.admit() is Admission.PROBE


def test_each_state_change_is_logged_once(caplog):
    clock = Clock()
    b = breaker(clock)
    with caplog.at_level(logging.DEBUG, logger="rest_spec.drafter.core.breaker"):
        for _ in range(10):
            b.failed()
        for _ in range(4):
            clock.now += 1
            b.admit()
            b.failed()
        clock.now += 1
        b.admit()
        b.succeeded()
        b.succeeded()
    opened = [r for r in caplog.records if "failed 3 calls in a row" in r.message]
    back = [r for r in caplog.records if "answers again" in r.message]
    assert [r.levelno for r in opened] == [logging.WARNING] and [r.levelno for r in back] == [logging.INFO]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r not in opened + back)


def test_a_breaker_refuses_nonsense():
    with pytest.raises(ValueError):
        CircuitBreaker("x", failures=0)
    with pytest.raises(ValueError):
        CircuitBreaker("x", backoff=2.0, max_backoff=1.0)


# ---- real server processes ---------------------------------------------------------------------


def serve(index: Path, port: int = 0) -> DatastoreProcess:
    server = DatastoreProcess("serve", "--index", index, "--port", port).wait()
    assert server.address, server.output
    return server


def port_of(server: DatastoreProcess) -> int:
    return int(server.address.rsplit(":", 1)[1])


def stop_all(*servers: DatastoreProcess | None) -> None:
    for server in servers:
        if server is not None:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)
            server.kill()


class Fault:
    """What happens to a server of ``index`` and when, as the steps see it: ``strike`` (SIGSTOP or
    SIGKILL) at ``fault``; ``restore`` (SIGCONT, or a new server on the same port) once the breaker
    is open and ``hold`` seconds have passed, at ``back``; ``resumed``: the first time the breaker
    is closed again (a probe was answered). ``step`` runs between steps of the loop."""

    def __init__(self, server: DatastoreProcess, index: Path, breaker: CircuitBreaker, how: int, hold: float) -> None:
        self.server, self.index, self.breaker, self.how, self.hold = server, index, breaker, how, hold
        self.fault = self.back = self.resumed = None
        self.restarted: DatastoreProcess | None = None
        self.opened = False

    def strike(self) -> None:
        if self.how == signal.SIGSTOP:
            self.server.freeze()
        else:
            self.server.kill()
        self.fault = time.monotonic()

    def step(self) -> None:
        if self.fault is None or self.resumed is not None:
            return
        if self.back is None:
            self.opened |= not self.breaker.closed
            if self.opened and time.monotonic() - self.fault >= self.hold:
                self.restore()
        elif self.breaker.closed:
            self.resumed = time.monotonic()

    def restore(self) -> None:
        if self.how == signal.SIGSTOP:
            self.server.proc.send_signal(signal.SIGCONT)
        else:
            self.server.proc.wait(timeout=30)
            self.restarted = serve(self.index, port_of(self.server))
        self.back = time.monotonic()

    @property
    def recovery(self) -> float:
        assert self.back is not None and self.resumed is not None, (
            "the server never came back, or drafting never resumed"
        )
        return self.resumed - self.back


FAULT_IDS = ["frozen", "killed"]  # SIGSTOP, SIGKILL


@pytest.fixture(scope="module")
def synthetic_index(tmp_path_factory):
    return write_index(tmp_path_factory.mktemp("faults") / "synthetic", synthetic_corpus(), CORPUS_VOCAB)


@pytest.mark.server
@pytest.mark.parametrize(
    "how, overlap",
    [(signal.SIGSTOP, False), (signal.SIGKILL, False), (signal.SIGSTOP, True)],
    ids=FAULT_IDS + ["frozen-overlap"],
)
def test_the_scheduler_stops_asking_a_dead_datastore_and_asks_again_once_it_is_back(synthetic_index, how, overlap):
    """``DraftScheduler`` steps (a sleep stands for each forward, one token commits per step) against a
    real server: after a few failed steps none asks the datastore or waits for it, a few probes go
    out, and once the server is back (resumed, or started again on its port) a probe is answered
    within about a second and the steps draft from it again."""
    step = 0.1
    text = [token for doc in synthetic_corpus() for token in doc]
    contexts = [text[: 20 + k] for k in range(200)]
    server = serve(synthetic_index)
    fault = None

    def one_step(context: list[int]) -> int:
        trees = drafting.trees([context])
        drafting.speculate(trees)
        time.sleep(step)
        drafting.verified(step)
        return len(trees[0])

    try:
        with RemoteDrafter(server.address) as remote:
            fault = Fault(server, synthetic_index, remote.breaker, how, hold=1.0)
            drafting = DraftScheduler(remote, DraftConfig(budget=16), OverlapConfig(enabled=overlap), step_seconds=step)
            waits = []  # per step after the fault, seconds it waited for its draft
            for number, context in enumerate(contexts[:-10]):
                if number == 10:
                    fault.strike()
                fault.step()
                if fault.resumed is not None:
                    break
                start = time.perf_counter()
                one_step(context)
                if fault.fault is not None:
                    waits.append(time.perf_counter() - start - step)
            stats = drafting.stats
            assert fault.recovery < RECOVERY_BOUND
            # 3 failed steps opened it, the last found it closed again (its probe answered), one may have had its
            # reply before the fault (speculation during the forward); the rest never asked
            assert stats.breaker_open_steps >= len(waits) - 5
            assert 1 <= stats.probes <= stats.breaker_open_steps
            assert max(waits) < 0.5, waits  # a failing step waits a quarter step; an open one not at all
            drafted = [one_step(context) for context in contexts[-10:]]
            drafting.close()
            assert any(drafted) and remote.breaker.closed and remote.breaker.openings == 1
    finally:
        stop_all(server, fault.restarted if fault else None)


# ---- generation with SmolLM2 ------------------------------------------------------------------------

STDLIB_MODULES = (
    "argparse contextlib dataclasses functools inspect json/decoder os shutil subprocess textwrap typing".split()
)
KEY = CostKey("synthetic", "", 0, "test", "float32")
CPU_COST = VerifyCost(KEY, 512, (1, 2, 4, 8, 16, 32, 64), (1.0, 1.15, 1.4, 1.9, 2.0, 2.5, 4.0))
CONFIG = DraftConfig(budget=64, max_depth=10)
PAPER = DraftConfig(budget=16, max_depth=6)
NEW_TOKENS = 96
CLI_TOKENS = 48


@pytest.fixture(scope="module")
def code_index(smollm2, tmp_path_factory):
    """A real index of a dozen standard-library modules tokenized for SmolLM2, with its fingerprint
    (so that ``rest-generate`` accepts it)."""
    model, tokenizer = smollm2
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [stdlib / f"{name}.py" for name in STDLIB_MODULES]
    docs = [tokenizer(path.read_text(encoding="utf-8")).input_ids for path in sources if path.exists()]
    assert len(docs) >= 8
    path = tmp_path_factory.mktemp("faults") / "code"
    return write_index(path, docs, model.config.vocab_size, fingerprint=tokenizer_fingerprint(tokenizer))


@pytest.fixture(scope="module")
def prompt(smollm2):
    """The first HumanEval prompt, as text and ids, and plain decoding's output for it."""
    model, tokenizer = smollm2
    text = humaneval_prompts(1)[0]
    ids = tokenizer(text).input_ids
    plain = generate(model, ids, None, max_new_tokens=NEW_TOKENS).output_ids
    assert len(plain) == NEW_TOKENS  # no early end: every fault lands mid-generation
    return text, ids, plain


class BetweenSteps(StoppingCriteria):
    """Never stops generation; runs ``fault.strike`` when the ``at``-th new token is committed, and
    ``fault.step`` at every token after it."""

    def __init__(self, at: int, fault: Fault) -> None:
        self.at, self.fault, self.calls = at, fault, 0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.calls += 1
        if self.calls == self.at:
            self.fault.strike()
        self.fault.step()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.model
@pytest.mark.server
@pytest.mark.parametrize(
    "how", [signal.SIGSTOP, pytest.param(signal.SIGKILL, marks=pytest.mark.core)], ids=FAULT_IDS
)  # killed: the default run's end-to-end fault
def test_generation_through_a_dead_datastore_is_plain_decoding_and_drafts_again_once_it_is_back(
    smollm2, code_index, prompt, how
):
    """SmolLM2 drafting from a real server (adaptive: the request's own text is what steps fall
    back on) that is frozen or killed after 8 tokens and back a second later: plain decoding's
    output, the breaker opened once, and it closed (a remote draft answered) soon after."""
    model, _ = smollm2
    _, ids, plain = prompt
    server = serve(code_index)
    fault = None
    try:
        with RemoteDrafter(server.address) as remote:
            fault = Fault(server, code_index, remote.breaker, how, hold=1.0)
            drafter = AdaptiveDrafter(remote, cost=CPU_COST, config=CONFIG)
            result = generate(
                model,
                ids,
                drafter,
                max_new_tokens=NEW_TOKENS,
                config=CONFIG,
                stopping_criteria=StoppingCriteriaList([BetweenSteps(8, fault)]),
            )
            assert result.output_ids == plain
            stats = result.drafting
            assert remote.breaker.openings == 1 and remote.breaker.closed, stats.summary()
            assert stats.breaker_open_steps > 0 and stats.probes > 0 and stats.fallbacks >= stats.breaker_open_steps
            assert fault.recovery < RECOVERY_BOUND
    finally:
        stop_all(server, fault.restarted if fault else None)


@pytest.mark.model
@pytest.mark.server
@pytest.mark.cli
def test_rest_generate_completes_against_a_server_frozen_for_good(smollm2, code_index, prompt):
    """``rest-generate --datastore HOST:PORT`` with the server frozen (SIGSTOP) early in the
    generation and never resumed: exit 0, plain decoding's output, the breaker opened once (its
    warning), and the output is not sent to the frozen server (no wait at the end of the prompt)."""
    text, _, plain = prompt
    server = serve(code_index)
    try:
        argv = [
            *(sys.executable, "-m", "rest_spec.drafter", "--datastore", server.address, "--prompt", text),
            *("--max-new-tokens", str(CLI_TOKENS), "--budget", str(PAPER.budget), "--max-depth", str(PAPER.max_depth)),
            *("--json", "-v"),
        ]
        # one torch thread, as in process (conftest): on a busy 2-core machine two cost far more
        env = {**os.environ, **ONE_THREAD}
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        log: list[str] = []

        def freeze_once_generating() -> None:
            for line in proc.stderr:
                log.append(line)
                if "generating 1/1" in line:
                    time.sleep(0.3)
                    server.freeze()

        reader = threading.Thread(target=freeze_once_generating, daemon=True)
        reader.start()
        try:
            status = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        reader.join(timeout=30)
        assert status == 0, "".join(log)
        out = proc.stdout.read()
        record = json.loads(out.strip().splitlines()[-1])
        assert record["output_ids"] == plain[:CLI_TOKENS]
        drafting = record["drafting"]
        assert drafting["breaker_open_steps"] > 0 and drafting["probes"] > 0, drafting
        messages = "".join(log)
        assert messages.count("failed 3 calls in a row") == 1, messages
        assert "output not stored" in messages and "output not sent" in messages, messages
    finally:
        stop_all(server)


# ---- outputs on their way to the store ---------------------------------------------------------


def test_outputs_are_stored_off_the_callers_thread(synthetic_index):
    with LocalDrafter.open(synthetic_index) as store:
        uploader = OutputUploader(store)
        assert all(uploader.submit([401 + i, 402 + i, 403 + i]) for i in range(3))
        uploader.close()  # stores what is queued
        assert uploader.stats == UploadStats(outputs_added=3) and len(store.outputs) == 3
        assert not uploader.submit([1, 2, 3]) and uploader.stats.outputs_dropped == 1  # closed


@pytest.mark.server
def test_a_frozen_datastore_fills_the_queue_and_the_rest_is_dropped_not_kept(synthetic_index):
    """Two outputs may wait for a frozen server (one in flight, one queued); the next ones are
    dropped at once and counted. Once the server is back the queued ones are stored."""
    server = serve(synthetic_index)
    try:
        with RemoteDrafter(server.address, timeout=30) as drafter:
            uploader = OutputUploader(drafter, max_pending=2)
            server.freeze()
            submitted = [uploader.submit([401, 402, i]) for i in range(5)]
            assert submitted == [True, True, False, False, False]
            assert uploader.stats.outputs_dropped == 3 and uploader.stats.outputs_added == 0
            server.proc.send_signal(signal.SIGCONT)
            uploader.close()
            assert uploader.stats == UploadStats(outputs_added=2, outputs_dropped=3)
            (trees,) = drafter.start_sources([[401, 402]], DraftConfig(n_min=2), outputs=True).result()
            assert sorted(trees.outputs.tokens.tolist()) == [0, 1]  # the two that waited were stored
    finally:
        stop_all(server)
