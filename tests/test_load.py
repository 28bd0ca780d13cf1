"""Load on the real service: 32 clients in 4 processes draft from a `rest-datastore serve` process
over a real index for 30 s: no call fails and the server's memory stays flat. The figures are
printed (`pytest -s`); benchmarks/load.py records them on the python-stdlib index."""

from __future__ import annotations

import json

import pytest

from benchmarks.load import run_load
from tests.helpers import CORPUS_VOCAB, synthetic_corpus, write_index

pytestmark = pytest.mark.server


def test_32_clients_for_30_seconds_without_errors_or_memory_growth(tmp_path):
    index = write_index(tmp_path / "idx", synthetic_corpus(), CORPUS_VOCAB, shard_tokens=10_000)
    figures = run_load(index, clients=32, seconds=30, processes=4, warmup=5)
    print(json.dumps(figures))
    assert figures["requests"] > 32 and figures["errors"] == 0, figures
    assert figures["latency_ms"]["p99"] is not None
    assert figures["server_rss_mb"]["growth"] < 64, figures
