"""How the test command spreads itself over the cores (``tests/conftest.py``): the whole suite on
two pytest-xdist workers, whole files to each; whatever names its tests, or needs one process, in
one process."""

from __future__ import annotations

import os

import pytest

from tests import conftest

pytest_plugins = ["pytester"]
CORES = len(os.sched_getaffinity(0))


def workers(pytester: pytest.Pytester, *args: str) -> tuple[int | None, str]:
    """(numprocesses, dist) once the suite's hook has seen the command line ``args``."""
    config = pytester.parseconfig(*args)
    conftest.pytest_cmdline_main(config)
    return config.option.numprocesses, config.option.dist


def test_the_whole_suite_runs_on_two_cores_a_file_at_a_time(pytester):
    assert workers(pytester) == ((2, "loadfile") if CORES >= 2 else (None, "no"))


@pytest.mark.parametrize(
    "args, expected",
    [
        (("tests/test_index.py",), (None, "no")),  # named tests
        (("-n", "0"), (0, "no")),  # the caller's choice
        (("-n", "3", "--dist", "load"), (3, "load")),
        (("-s",), (None, "no")),  # output as it is written
        (("--pdb",), (None, "no")),
        (("--collect-only",), (None, "no")),
    ],
)
def test_named_tests_a_chosen_count_and_one_process_needs_are_left_alone(pytester, args, expected):
    assert workers(pytester, *args) == expected


def test_without_xdist_nothing_changes(pytester):
    config = pytester.parseconfig("-p", "no:xdist")
    conftest.pytest_cmdline_main(config)
    assert not hasattr(config.option, "numprocesses")


# ---- which tests a run keeps: the default run, --full, and --beyond-default (what --full adds)

SUITE = """
import pytest
from hypothesis import given, settings, strategies as st

from tests.tiers import examples


def test_unit():
    pass


@pytest.mark.server
def test_server():
    pass


@pytest.mark.server
@pytest.mark.core
def test_server_core():
    pass


@settings(max_examples=examples(100), deadline=None)
@given(st.integers())
def test_property(x):
    pass


@pytest.mark.parametrize("k", [1, 2])
@settings(max_examples=examples(50), deadline=None)
@given(x=st.integers())
def test_parametrized_property(k, x):
    pass


@settings(max_examples=examples(4), deadline=None)  # the default run's count is the whole of it
@given(st.integers())
def test_small_property(x):
    pass


@settings(max_examples=15, deadline=None)  # a fixed count: the same in every run
@given(st.integers())
def test_fixed_property(x):
    pass


@pytest.mark.build
@settings(max_examples=examples(30), deadline=None)
@given(st.integers())
def test_build_property(x):
    pass
"""


def kept(pytester: pytest.Pytester, *args: str) -> dict[str, int | None]:
    """Each test the run with ``args`` passed: its Hypothesis example count (None for a plain test)."""
    pytester.makeconftest("from tests.conftest import *  # noqa: F403")
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-v",
                                           "--hypothesis-show-statistics", *args)  # fmt: skip
    assert result.ret == 0, result.outlines
    passed, counts, current = {}, {}, None
    for line in result.outlines:
        if " PASSED" in line:
            passed[line.split("::", 1)[1].split(" PASSED")[0]] = None
        elif line.startswith("test_suite.py::"):
            current = line.split("::", 1)[1].split(":")[0]
        elif "Stopped because settings.max_examples=" in line:
            counts[current] = int(line.rsplit("=", 1)[1])
    return {test: counts.get(test) for test in passed}


@pytest.fixture
def suite_env(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(conftest.ROOT))  # the suite's conftest and tiers
    monkeypatch.delenv("REST_TESTS", raising=False)
    return pytester


def test_the_default_run_and_beyond_default_together_are_the_full_run_each_example_count_whole(suite_env):
    default, full, beyond = kept(suite_env), kept(suite_env, "--full"), kept(suite_env, "--beyond-default")
    assert default == {
        "test_unit": None,
        "test_server_core": None,
        "test_property": 20,
        "test_parametrized_property[1]": 10,
        "test_parametrized_property[2]": 10,
        "test_small_property": 4,
        "test_fixed_property": 15,
    }
    assert full == {
        **default,
        "test_server": None,
        "test_property": 100,
        "test_parametrized_property[1]": 50,
        "test_parametrized_property[2]": 50,
        "test_build_property": 30,
    }
    # the tests the default run leaves out, and its properties on the rest of their examples: none twice
    assert beyond == {
        "test_server": None,
        "test_build_property": 30,
        "test_property": 80,
        "test_parametrized_property[1]": 40,
        "test_parametrized_property[2]": 40,
    }
    assert set(default) | set(beyond) == set(full)
    assert all(default.get(test, 0) + count == full[test] for test, count in beyond.items() if count is not None)


def test_full_and_beyond_default_exclude_each_other(suite_env):
    suite_env.makeconftest("from tests.conftest import *  # noqa: F403")
    suite_env.makepyfile(test_suite=SUITE)
    result = suite_env.runpytest_subprocess("-p", "no:xdist", "--full", "--beyond-default")
    assert result.ret != 0
    assert "one of them" in result.stderr.str()
