"""What a drafter learned outlives its process (``drafter.core.calibration_memory``): a new drafter
given the memory prices chains as the one that learned them did, a hostile or foreign file is a
warning and a fresh start, the proposer keeps its file where its option says."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.batch_cost import BatchCost
from rest_spec.drafter.core.calibration_memory import CalibrationMemory, calibration_path
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.steps import finish_step
from rest_spec.drafter.vllm.proposer import RestOptions
from tests.helpers import MODEL_VOCAB, write_index

CONFIG = DraftConfig(budget=64, max_depth=6)
DOCS = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4 + [list(range(20, 60))]


def _drafter(base, memory=None) -> AdaptiveDrafter:
    return AdaptiveDrafter(
        base, cost=BatchCost(), config=CONFIG, sources=("index", "request"), chains=True, calibrate_chains=True,
        memory=memory,
    )  # fmt: skip


def _step(drafter, context, request):
    sessions = drafter.advance([context], [request])
    return finish_step(drafter, sessions, drafter.start_shared([context], CONFIG).result(), CONFIG)[0]


def _serve(drafter, requests: int) -> None:
    """Requests whose chains are right on their first token only: 1 2 3, then 50."""
    for i in range(requests):
        _step(drafter, [30, 1, 2], f"r{i}")
        _step(drafter, [30, 1, 2, 3, 50], f"r{i}")
        drafter.finish([f"r{i}"])


@pytest.fixture
def base(tmp_path):
    with LocalDrafter.open(write_index(tmp_path / "idx", DOCS, MODEL_VOCAB)) as base:
        yield base


def test_a_new_drafter_given_the_memory_prices_chains_as_the_one_that_learned_them(base, tmp_path):
    memory = CalibrationMemory(tmp_path / "cache" / "calibration" / "m.npz")
    learning = _drafter(base, memory)
    fresh_claim = float(_step(_drafter(base), [30, 1, 2], "probe").scores.sum())
    _serve(learning, 150)
    learned_claim = float(_step(learning, [30, 1, 2], "probe").scores.sum())
    assert learned_claim < 0.6 * fresh_claim
    learning.remember()
    assert memory.path.is_file() and not list(memory.path.parent.glob(".*.tmp"))

    restarted = _drafter(base, memory)
    assert float(_step(restarted, [30, 1, 2], "probe").scores.sum()) == pytest.approx(learned_claim, rel=0.02)
    learned, recalled = learning.learned(), restarted.learned()
    assert learned.keys() == recalled.keys() and list(recalled["sources"]) == ["index", "request"]
    for name in ("source.0.observed", "chain.trials", "chain.hits"):
        np.testing.assert_allclose(recalled[name], learned[name], rtol=0.05)


def test_close_keeps_what_was_learned(base, tmp_path):
    memory = CalibrationMemory(tmp_path / "m.npz")
    drafter = _drafter(LocalDrafter(base.datastore), memory)
    _serve(drafter, 20)
    assert not memory.path.exists()  # saved every SAVE_EVERY seconds: not yet
    learned = drafter.learned()
    assert learned["chain.trials"].sum() > 20
    drafter.close()
    for name, table in memory.load().items():
        np.testing.assert_array_equal(table, learned[name])


def _hostile_files(tmp_path, learned):
    shapes = dict(learned)
    shapes["chain.trials"] = learned["chain.trials"][:, :3]
    negative = {**learned, "source.0.observed": -learned["source.0.observed"] - 1}
    more_hits = {**learned, "chain.hits": learned["chain.trials"] + 5}
    other = {**learned, "sources": np.array(["index", "outputs"])}
    hotter = {
        **learned,
        "source.9.observed": learned["source.0.observed"],
        "source.9.predicted": learned["source.0.observed"],
    }
    return {
        "garbage": (b"\x00not a zip" * 10, "unreadable"),
        "pickled": (_npz(format=np.int64(1), objects=np.array([{"a": 1}], dtype=object)), "unreadable"),
        "another format": (_npz(format=np.int64(99), **learned), "of another format"),
        "no format": (_npz(**learned), "of another format"),
        "other shapes": (_npz(format=np.int64(1), **shapes), "does not fit"),
        "negative counts": (_npz(format=np.int64(1), **negative), "does not fit"),
        "more hits than trials": (_npz(format=np.int64(1), **more_hits), "does not fit"),
        "other sources": (_npz(format=np.int64(1), **other), "does not fit"),
        "no such sampling setting": (_npz(format=np.int64(1), **hotter), "does not fit"),
    }


def _npz(**arrays) -> bytes:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_a_hostile_or_foreign_file_is_a_warning_and_a_fresh_start(base, tmp_path, caplog):
    learning = _drafter(base)
    _serve(learning, 30)
    fresh = _drafter(base).learned()
    for name, (data, why) in _hostile_files(tmp_path, learning.learned()).items():
        path = tmp_path / f"{name}.npz"
        path.write_bytes(data)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            drafter = _drafter(base, CalibrationMemory(path))
        assert why in caplog.text and str(path) in caplog.text, name
        for key, table in drafter.learned().items():  # nothing of the file taken, even in part
            np.testing.assert_array_equal(table, fresh[key], err_msg=name)
        assert path.read_bytes() == data  # and nothing overwritten before this drafter learns anything


def test_the_path_is_per_model_tokenizer_and_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_CACHE_DIR", str(tmp_path))
    path = calibration_path("/models/SmolLM2-135M/", "fp1", ("index", "request"))
    assert path.parent == tmp_path / "calibration" and path.name.startswith("SmolLM2-135M-")
    others = {
        calibration_path("/models/other", "fp1", ("index", "request")),
        calibration_path("/models/SmolLM2-135M", "fp2", ("index", "request")),
        calibration_path("/models/SmolLM2-135M", "fp1", ("index", "request", "suffix")),
    }
    assert path not in others and len(others) == 3


def test_the_option_names_a_file_or_none():
    assert RestOptions.parse({"datastore": "idx"}, environ={}).calibration_file is None
    shared = {"REST_CALIBRATION_FILE": "/fleet/calibration.npz"}
    assert RestOptions.parse({"datastore": "idx"}, environ=shared).calibration_file == "/fleet/calibration.npz"
    assert RestOptions.parse({"datastore": "idx", "calibration_file": "none"}, environ={}).calibration_file == "none"


def test_the_proposer_keeps_its_calibrations_where_the_option_says(base, tmp_path, monkeypatch):
    from rest_spec.drafter.vllm.proposer import RestProposer

    monkeypatch.setenv("REST_CACHE_DIR", str(tmp_path / "cache"))
    proposer = RestProposer.__new__(RestProposer)
    proposer.source = base
    fingerprint = base.info().tokenizer_fingerprint
    for option, path in (
        (None, calibration_path("/models/m", fingerprint, ("index", "suffix"))),
        (str(tmp_path / "fleet.npz"), tmp_path / "fleet.npz"),
        ("none", None),
    ):
        proposer.options = RestOptions.parse({"datastore": "idx", "calibration_file": option}, environ={})
        memory = proposer._memory("/models/m", ("index", "suffix"))
        assert (memory and memory.path) == path, option
