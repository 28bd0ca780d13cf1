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
