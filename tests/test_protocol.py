"""The drafting protocol's contract (``drafter.core.protocol``): what each drafter declares, the one
step sequence the drafter and the scheduler both run, and the one error for a store of outputs
that is not there -- with a real index, a real server on a loopback port and a real model."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from rest_spec.common.errors import NoOutputStoreError
from rest_spec.common.types import DraftConfig, DraftTree, SourceTrees
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.outputs import OutputStore
from rest_spec.datastore.server import DatastoreServer, ServerConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.protocol import StepDrafter
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.core.scheduler import NO_OVERLAP, DraftScheduler
from rest_spec.drafter.core.steps import (
    SUFFIX_CUTS,
    Deferred,
    DraftSource,
    PlainSteps,
    as_source,
    draft_step,
    steps_for,
)
from tests.helpers import CORPUS_VOCAB as VOCAB
from tests.helpers import ScriptedDrafter, contexts_from, synthetic_corpus, write_index

DOCS = synthetic_corpus()
CONFIG = DraftConfig(budget=16, max_depth=4)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return write_index(tmp_path_factory.mktemp("protocol") / "idx", DOCS, VOCAB, shard_tokens=10_000)


@pytest.fixture(scope="module")
def server(index):
    with Datastore.open(index) as store, OutputStore(10_000, vocab_size=VOCAB) as outputs:
        with DatastoreServer(store, ServerConfig(port=0, workers=2), outputs) as server:
            yield server


class EchoDrafter(ScriptedDrafter):
    """A user's ``Drafter`` that declares nothing: drafts the context's last token twice."""

    def draft(self, context, config: DraftConfig) -> DraftTree:
        return DraftTree(np.array([context[-1], context[-1]]), np.array([-1, 0]), np.array([2, 1]), 1, 2, 2)


def test_a_drafter_that_declares_nothing_gets_the_defaults():
    drafter = EchoDrafter()
    source = as_source(drafter)
    assert isinstance(source, DraftSource) and source is not drafter
    assert source.reads_suffixes is False and source.breaker is None
    pending = source.start_sources([[1, 2], [3]], CONFIG)
    assert isinstance(pending, Deferred)  # work done when collected
    assert pending.result() == [
        SourceTrees(drafter.draft([1, 2], CONFIG), DraftTree.empty()),
        SourceTrees(drafter.draft([3], CONFIG), DraftTree.empty()),
    ]
    steps = steps_for(drafter)
    assert isinstance(steps, PlainSteps) and steps.cost is None and steps.source.reads_suffixes is False
    assert draft_step(steps, [[5, 6]], DraftConfig(budget=1)) == [drafter.draft([5, 6], CONFIG).subset(np.array([0]))]


def test_this_projects_sources_declare_what_the_scheduler_may_use(index, server):
    with LocalDrafter.open(index) as local, RemoteDrafter(server.address) as remote:
        for source in (local, remote):
            assert as_source(source) is source and source.reads_suffixes is True
        assert local.breaker is None and remote.breaker is not None  # a remote one outlives generations
        contexts = contexts_from(DOCS, 6, seed=3)
        in_flight = remote.start_sources(contexts, CONFIG, outputs=True, timeout=5)
        assert not isinstance(in_flight, Deferred)  # an RPC started at once
        assert in_flight.result(timeout=5) == local.start_sources(contexts, CONFIG, outputs=True).result()
        cancelled = local.start_sources(contexts, CONFIG)
        assert cancelled.cancel()
        with pytest.raises(CancelledError):
            cancelled.result()


def test_in_process_work_under_way_is_not_cancelled_and_its_result_stands():
    """A ``Deferred``'s work running in one thread (the scheduler's speculation) cannot be stopped
    by a cancel from another (the decoding thread giving up on it): the cancel says False, the
    result stands, and a second caller waits for it rather than reading nothing."""
    started, release = threading.Event(), threading.Event()

    def work():
        started.set()
        release.wait(5)
        return [7]

    pending = Deferred(work)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(pending.result)
        assert started.wait(5)
        assert pending.cancel() is False
        second = pool.submit(pending.result)
        release.set()
        assert first.result(5) == second.result(5) == [7]
    assert pending.cancel() is False  # done: nothing left to stop


def test_the_adaptive_drafter_and_the_scheduler_run_one_sequence(index):
    """``AdaptiveDrafter.draft_batch``, ``draft_step`` and the scheduler without overlap give the
    same trees step after step, the calibration learning the same way."""
    contexts = [context for context in contexts_from(DOCS, 40, seed=5) if len(context) > 8][:6]
    with LocalDrafter.open(index) as local:
        drafters = [
            AdaptiveDrafter(local, cost=None, sources=("index", "request"), suffixes=SUFFIX_CUTS) for _ in range(3)
        ]
        assert all(steps_for(drafter) is drafter and isinstance(drafter, StepDrafter) for drafter in drafters)
        scheduler = DraftScheduler(drafters[2], CONFIG, NO_OVERLAP)
        try:
            for step in range(4, 9):  # the contexts grow: each step continues the last one's requests
                rows = [context[:step] for context in contexts]
                batch = drafters[0].draft_batch(rows, CONFIG)
                assert draft_step(drafters[1], [list(row) for row in rows], CONFIG) == batch
                assert scheduler.trees(rows) == batch
        finally:
            scheduler.close()
        weights = [drafter.calibration.weights for drafter in drafters]
        np.testing.assert_array_equal(weights[0], weights[1])
        np.testing.assert_array_equal(weights[0], weights[2])


def test_a_store_that_keeps_no_outputs_raises_one_error_everywhere(index):
    with Datastore.open(index) as store, DatastoreServer(store, ServerConfig(port=0, workers=1)) as server:
        with RemoteDrafter(server.address) as remote, pytest.raises(NoOutputStoreError, match="keeps no outputs"):
            remote.add_output([1, 2])
    with LocalDrafter.open(index, outputs_max_tokens=0) as local:
        with pytest.raises(NoOutputStoreError, match="keeps no outputs"):
            local.add_output([1, 2])
        with pytest.raises(NoOutputStoreError, match="keeps no outputs"):
            AdaptiveDrafter(EchoDrafter(), cost=None, sources=("index",)).add_output([1, 2])


@pytest.mark.cli
def test_generation_from_a_local_index_never_imports_grpc(index):
    script = f"""
import sys
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.hf.generate import generate
from rest_spec.drafter.core.local import LocalDrafter
from tests.helpers import tiny_causal_lm
with LocalDrafter.open({str(index)!r}) as local:
    generate(tiny_causal_lm("llama"), [1, 2, 3, 4], AdaptiveDrafter(local, cost=None), max_new_tokens=4, overlap=True)
assert "grpc" not in sys.modules, "grpc was imported"
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, cwd=Path(__file__).resolve().parents[1])


def test_the_step_helpers_that_moved_to_steps_still_answer_from_protocol():
    from rest_spec.drafter.core import protocol, steps

    with pytest.warns(DeprecationWarning, match="drafter.core.protocol.Mark moved to rest_spec.drafter.core.steps"):
        assert protocol.Mark is steps.Mark
    with pytest.raises(AttributeError):
        protocol.no_such_name  # noqa: B018
    assert set(protocol.__all__) == {"BatchRule", "Drafter", "Pending", "SourceDrafter", "StepDrafter"}
