"""benchmarks.sharded on small real indexes written by the project's writer: real shard-server,
server and router processes on loopback; the routers answer every context as the index does in
process, latency and throughput come out sane, and (slow, the real model) generation through
every topology equals plain decoding."""

from __future__ import annotations

import contextlib
import os

import pytest

from benchmarks.harness.report import RESULTS
from benchmarks.harness.sets import humaneval_prompts
from benchmarks.sharded import (
    draft_latency,
    exactness,
    generation,
    generation_modes,
    parse_args,
    serving,
    shard_specs,
    throughput,
)
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore
from tests.helpers import CORPUS_VOCAB, contexts_from, synthetic_corpus, write_index

pytestmark = pytest.mark.bench

REPEATED = [7, 8, 9]  # a phrase in 1,500 places: matching it samples, so routers run their second round


def corpus() -> list[list[int]]:
    return synthetic_corpus() + [REPEATED * 30 for _ in range(50)]


def sharded_index(path, docs, vocab_size, shards: int = 4):
    """An index of ``docs`` in ``shards`` shards."""
    index = write_index(path, docs, vocab_size, shard_tokens=sum(map(len, docs)) // shards + 100)
    with Datastore.open(index) as store:
        assert len(store.manifest.shards) == shards
    return index


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_shard_specs_split_evenly_and_contiguously():
    assert shard_specs(4, 1) == ["0-3"]
    assert shard_specs(4, 2) == ["0-1", "2-3"]
    assert shard_specs(4, 4) == ["0", "1", "2", "3"]
    assert shard_specs(5, 2) == ["0-2", "3-4"]


def test_only_a_run_with_every_default_writes_the_results_file(capsys):
    assert parse_args([]).out == RESULTS / "sharded.json"
    assert parse_args(["--prompts", "40", "--contexts", "5000"]).out == RESULTS / "sharded.json"
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--prompts", "1"])
    assert exit_.value.code == 2 and "--out is needed with --prompts" in capsys.readouterr().err
    assert parse_args(["--prompts", "1", "--out", "x.json"]).out.name == "x.json"
    for bad in (["--routers", "1,x"], ["--clients", "0"], ["--budget", "0"], ["--contexts", "0"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args([*bad, "--out", "x.json"])
        assert exit_.value.code == 2


def test_routers_answer_as_the_index_and_latency_and_throughput_are_measured(tmp_path):
    docs = corpus()
    index = sharded_index(tmp_path / "idx", docs, CORPUS_VOCAB)
    contexts = contexts_from(docs, 300, seed=3) + [REPEATED * 3, [CORPUS_VOCAB - 1]]
    config = DraftConfig()
    logs = tmp_path / "logs"
    logs.mkdir()
    with serving(index, (1, 2, 4), logs, workers=2) as topologies:
        assert list(topologies) == ["serve", "router/1", "router/2", "router/4"]
        assert [len(t.pids) for t in topologies.values()] == [1, 2, 3, 5]
        routers = [t for t in topologies.values() if t.name != "serve"]

        exact = exactness(index, routers, contexts, 16, config)
        assert exact["mismatches"] == {"router/1": 0, "router/2": 0, "router/4": 0}, exact
        assert exact["contexts"] == len(contexts) and 0 < exact["matched"] < len(contexts)
        assert exact["sampled"] > 0  # the second round ran

        latency = draft_latency(index, list(topologies.values()), contexts[:40], config)
        assert set(latency) == {"inprocess", *topologies}
        for figures in latency.values():
            assert figures["calls"] == 3 * 40 and 0 < figures["p50_ms"] <= figures["p99_ms"] < 1000, latency
        assert latency["inprocess"]["p50_ms"] < latency["router/4"]["p50_ms"]  # no network in process

        picked = [topologies["serve"], topologies["router/2"]]
        load = throughput(picked, contexts, (1, 2), config, seconds=0.5, warmup=0.1)
        for name in ("serve", "router/2"):
            for clients in ("1", "2"):
                figures = load[name][clients]
                assert figures["client_processes"] == int(clients)
                assert figures["requests"] > 0 and figures["errors"] == 0, figures
        assert load["router/2"]["1"]["server_rss_mb"]["after"] > load["serve"]["1"]["server_rss_mb"]["after"]
    assert all(gone(pid) for t in topologies.values() for pid in t.pids)
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        ["serve.log", "router-1.log", "router-1-shards-0-3.log", "router-2.log", "router-2-shards-0-1.log"]
        + ["router-2-shards-2-3.log", "router-4.log"]
        + [f"router-4-shards-{k}.log" for k in range(4)]
    )


def test_generation_through_every_topology_equals_plain_decoding(tmp_path):
    from rest_spec.drafter.hf.model import load_model

    tokenizer = load_tokenizer(None)
    texts = humaneval_prompts(40)
    index = sharded_index(tmp_path / "idx", [tokenizer(t).input_ids for t in texts], len(tokenizer))
    prompt = tokenizer(texts[0]).input_ids
    model = load_model(None)
    with serving(index, (2,), tmp_path, workers=2) as topologies, contextlib.ExitStack() as stack:
        modes = generation_modes(index, list(topologies.values()), None, stack)
        assert {name: overlap for name, (_, overlap) in modes.items()} == {
            "inprocess": False,
            "serve": True,
            "router/2": True,
        }
        result = generation(model, [prompt], modes, None, DraftConfig(), 8)
    summary = result["summary"]
    assert list(summary) == ["plain", "inprocess", "serve", "router/2"]
    for name, row in summary.items():
        assert row["identical"] == row["prompts"] == 1, name
        assert row["speed_vs_plain"] > 0 and row["mean_accepted"] >= 1
    assert summary["serve"]["speed_vs_serve"] == 1.0
    assert summary["router/2"]["mean_accepted"] == summary["serve"]["mean_accepted"]  # same drafts
    assert all(r["tokens"] == 8 for rows in result["per_prompt"].values() for r in rows)


def test_a_server_that_does_not_start_is_named_with_its_log(tmp_path):
    index = sharded_index(tmp_path / "idx", corpus(), CORPUS_VOCAB)
    with pytest.raises(
        RuntimeError, match=r"(?s)rest-datastore serve --index .* did not start: .*workers must be at least 1"
    ) as err:
        with serving(index, (2,), tmp_path, workers=0):
            pass
    assert "workers" in (tmp_path / "serve.log").read_text(), err.value
