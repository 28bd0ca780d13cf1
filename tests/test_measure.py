"""Measuring t(n) on real models, its cache and the ``rest-measure-cost`` command; the noise checks
(interleaved rounds, the lowest settled round, shapes no machine explains, re-timing, the
provisional table and its notes) with a synthetic step timer."""

from __future__ import annotations

import collections
import json
import logging
import platform
from pathlib import Path

import pytest
import torch

from rest_spec.common.cache import cache_dir
from rest_spec.common.types import DraftTree
from rest_spec.drafter.cli.measure_cost import main as measure_main
from rest_spec.drafter.core.corrected_cost import StepShape
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.hf.measure import (
    DEFAULT_ROUNDS,
    EXTRA_ROUNDS,
    cost_key,
    load_or_measure,
    measure_verify_cost,
    measured_steps,
)
from tests.helpers import tiny_causal_lm

MEASURE = dict(sizes=(1, 2, 4, 8), context_length=32, rounds=2)
NOTES = "rest_spec.drafter.core.cost_cache"  # the logger of the measurement's INFO notes


@pytest.fixture(scope="module")
def tiny_model():
    """A real model for the synthetic timer's tests: only its cost key is read."""
    return tiny_causal_lm("llama")


def notes(caplog) -> list[str]:
    """The measurement's notes about a table that is provisional or shaped like noise."""
    return [r.getMessage() for r in caplog.records if r.name == NOTES and "unconfirmed" in r.getMessage()]


SIZES = (1, 3, 4, 8, 16)  # no 2: its tree and its chain are the same one node


def test_measure_on_a_tiny_model_and_cache_the_result(tmp_path):
    model = tiny_causal_lm("llama")
    cost = measure_verify_cost(model, **MEASURE)
    assert cost.sizes == (1, 2, 4, 8) and cost.context_length == 32
    assert all(s > 0 for s in cost.seconds) and len(cost.chain_seconds) == 4 and all(s > 0 for s in cost.chain_seconds)
    assert cost.chain_seconds[0] == cost.seconds[0]  # no draft: the same step, timed once
    assert (cost.key.device, cost.key.dtype, cost.key.parameters) == (
        f"cpu-{platform.machine()}-{torch.get_num_threads()}threads",
        "float32",
        sum(p.numel() for p in model.parameters()),
    )
    first = load_or_measure(model, directory=tmp_path, **MEASURE)
    files = list((tmp_path / "verify-cost").glob("*.json"))
    assert len(files) == 1 and VerifyCost.from_json(files[0].read_text()) == first
    assert load_or_measure(model, directory=tmp_path, **MEASURE) == first  # read back, not re-timed
    again = load_or_measure(model, directory=tmp_path, remeasure=True, sizes=(1, 3), context_length=16, rounds=2)
    assert again.sizes == (1, 3)
    assert VerifyCost.from_json(files[0].read_text()) == again
    files[0].write_text("{not json")  # a damaged cache file is measured again, not fatal
    assert load_or_measure(model, directory=tmp_path, **MEASURE).sizes == MEASURE["sizes"]
    for field in ("chain_seconds", "unconfirmed"):  # written before chains were timed, or before noise checks
        stale = json.loads(files[0].read_text())
        del stale[field]
        files[0].write_text(json.dumps(stale))
        load_or_measure(model, directory=tmp_path, **MEASURE)
        assert field in json.loads(files[0].read_text())  # measured again
    with pytest.raises(ValueError, match="start at 1"):
        measure_verify_cost(model, sizes=(2, 4))
    other = tiny_causal_lm("qwen2")  # another model: another file
    load_or_measure(other, directory=tmp_path, **MEASURE)
    assert len(list((tmp_path / "verify-cost").glob("*.json"))) == 2


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("REST_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("REST_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "rest-spec"


def test_measure_command_writes_the_cache(tmp_path, monkeypatch, capsys):
    """``rest-measure-cost`` (its ``main``, in process): measures, caches under $REST_CACHE_DIR and
    prints the table; usage errors exit 2, a missing model 1, each in one line."""
    model_dir = tmp_path / "tiny"
    tiny_causal_lm("llama").save_pretrained(model_dir)
    monkeypatch.setenv("REST_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as help_exit:
        measure_main(["--help"])
    help_text = capsys.readouterr().out
    assert help_exit.value.code == 0 and "--context-length" in help_text and "--sizes" in help_text
    argv = ["--model", str(model_dir), "--sizes", "1,2,4", "--context-length", "16", "--rounds", "2", "--device", "cpu"]
    assert measure_main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["sizes"] == [1, 2, 4] and printed["key"]["model"] == str(model_dir)
    written = list((tmp_path / "cache" / "verify-cost").glob("*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text()) == printed
    with pytest.raises(SystemExit) as bad:
        measure_main(["--sizes", "1,x"])
    assert bad.value.code == 2 and "--sizes must be comma-separated integers" in capsys.readouterr().err
    assert measure_main(["--model", str(tmp_path / "nope"), "--sizes", "1"]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


class SyntheticTimer:
    """A deterministic step timer (no sleeping): the time of a block of n tokens in a layout, plus
    what ``interference(step, call, run)`` adds to the step's ``call``-th run and the timer's
    ``run``-th (0 first). Counts each step's runs."""

    def __init__(self, interference=lambda step, call, run: 0.0) -> None:
        self.interference = interference
        self.calls: collections.Counter[StepShape] = collections.Counter()

    @staticmethod
    def base(n: int, transposed: bool) -> float:
        return (0.040 + 0.002 * n) * (0.7 if transposed else 1.0)

    def __call__(self, tree: DraftTree, transposed: bool) -> float:
        step = StepShape(len(tree) + 1, len(tree) > 1 and tree.is_chain(), transposed)
        call, run = self.calls[step], sum(self.calls.values())
        self.calls[step] += 1
        return self.base(step.size, transposed) + self.interference(step, call, run)


def test_interleaved_rounds_see_through_a_burst_of_interference(tiny_model, caplog):
    model = tiny_model
    per_round = len(measured_steps(SIZES))
    timer = SyntheticTimer(lambda step, call, run: 0.5 if per_round <= run < 2 * per_round else 0.0)  # round 2
    with caplog.at_level(logging.INFO, logger=NOTES):
        cost = measure_verify_cost(model, sizes=SIZES, timer=timer)
    assert cost.seconds == tuple(SyntheticTimer.base(n, True) for n in SIZES)  # the lowest round's
    assert cost.transposed == (True,) * len(SIZES) and cost.unconfirmed == ()
    assert sum(timer.calls.values()) == DEFAULT_ROUNDS * len(measured_steps(SIZES))  # nothing timed again
    assert not notes(caplog)


def test_persistent_interference_is_retimed_then_left_unconfirmed_with_one_note(tiny_model, caplog, tmp_path):
    model = tiny_model
    # every run of a 4-token block 10 ms later than the one before: its rounds never agree
    timer = SyntheticTimer(lambda step, call, run: 0.010 * call if step.size == 4 else 0.0)
    with caplog.at_level(logging.INFO, logger=NOTES):
        cost = load_or_measure(model, directory=tmp_path, sizes=SIZES, timer=timer)
    assert cost.unconfirmed == (4,)
    assert {step: calls for step, calls in timer.calls.items() if calls != DEFAULT_ROUNDS} == {
        step: DEFAULT_ROUNDS + EXTRA_ROUNDS for step in measured_steps([4])
    }  # the unsettled steps alone, timed again
    [note] = notes(caplog)  # at INFO: the decoding loop heals the table, nothing is asked of the user
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"did not settle in {DEFAULT_ROUNDS + EXTRA_ROUNDS} rounds" in note and "n = 4" in note
    assert "rest-measure-cost" in note
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=NOTES):
        assert load_or_measure(model, directory=tmp_path, sizes=SIZES, timer=timer) == cost  # cached, provisional
    [note] = notes(caplog)
    assert "provisional" in note and "n = 4" in note and "rest-measure-cost" in note
    assert sum(timer.calls.values()) == DEFAULT_ROUNDS * len(measured_steps(SIZES)) + EXTRA_ROUNDS * 4


def test_timing_again_takes_at_most_about_half_the_first_rounds_time(tiny_model, caplog):
    model = tiny_model
    timer = SyntheticTimer(lambda step, call, run: 0.010 * call)  # every step: a machine ever busier
    with caplog.at_level(logging.INFO, logger=NOTES):
        cost = measure_verify_cost(model, sizes=SIZES, timer=timer)
    # the first rounds took 4.14 s (of step times): two more rounds (1.39 s, 1.53 s) spend the 2.07 s
    assert set(timer.calls.values()) == {DEFAULT_ROUNDS + 2}  # not EXTRA_ROUNDS more
    assert cost.unconfirmed == SIZES and len(notes(caplog)) == 1


def test_a_table_shaped_like_noise_is_timed_again(tiny_model, caplog):
    model = tiny_model
    # an 8-token block 10x dear in all four rounds (settled, yet 8x a 16-token block), then quiet
    timer = SyntheticTimer(
        lambda step, call, run: 9 * SyntheticTimer.base(8, step.transposed) if step.size == 8 and call < 4 else 0.0
    )
    with caplog.at_level(logging.INFO, logger=NOTES):
        cost = measure_verify_cost(model, sizes=SIZES, timer=timer)
    assert cost.seconds[SIZES.index(8)] == SyntheticTimer.base(8, True) and cost.unconfirmed == ()
    assert {timer.calls[step] for step in measured_steps([8])} == {DEFAULT_ROUNDS + 2}  # two rounds settle it
    assert not notes(caplog)


def test_measurement_refuses_a_single_round(tiny_model):
    with pytest.raises(ValueError, match="rounds >= 2"):
        measure_verify_cost(tiny_model, sizes=SIZES, rounds=1, timer=SyntheticTimer())


def test_a_planted_noisy_table_is_used_with_a_note_not_measured_again(tiny_model, caplog, tmp_path):
    model = tiny_model
    key = cost_key(model)
    ms = {1: 78.0, 2: 150.0, 4: 98.0, 8: 47.0}  # the issue's: t(2) 3.2x t(8), cached as settled
    noisy = VerifyCost(key, 512, tuple(ms), tuple(t / 1e3 for t in ms.values()), tuple(t / 1e3 for t in ms.values()))
    (tmp_path / "verify-cost").mkdir()
    (tmp_path / "verify-cost" / key.file_name()).write_text(noisy.to_json())
    timer = SyntheticTimer()
    with caplog.at_level(logging.INFO, logger=NOTES):
        assert load_or_measure(model, directory=tmp_path, timer=timer) == noisy
    [note] = notes(caplog)
    assert "provisional" in note and "t(2) = 150.0 ms is 3.2x t(8) = 47.0 ms" in note
    assert "rest-measure-cost" in note and not timer.calls


def test_decoding_without_drafts_reads_the_cached_table_and_measures_none(tiny_model, tmp_path, monkeypatch):
    """``rest-generate --no-draft`` (and ``--compare``'s runs without drafts) at the cached table's
    fastest layout when there is one; nothing is measured for them."""
    from rest_spec.drafter.hf.session import no_draft_cost

    monkeypatch.setenv("REST_CACHE_DIR", str(tmp_path))
    assert no_draft_cost(tiny_model) is None and not (tmp_path / "verify-cost").exists()
    table = load_or_measure(tiny_model, **MEASURE)
    assert no_draft_cost(tiny_model).table == table
