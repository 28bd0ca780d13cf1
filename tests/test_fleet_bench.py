"""benchmarks.fleet end to end on a tiny setting: two replicas, two warm-up requests decoded by plain
vLLM, two held-out HumanEval prompts of 8 new tokens; real engines (``benchmarks.harness.engines``) and a
real ``rest-datastore serve``. The report has its figures, every output equals plain's, the shared
store got every warm-up output over AddOutput (its own metrics say so), and each suffix replica's
cache held its share of the warm-up before it served its share of the held-out prompts. The fleet
that loaded the model's own corpus (``rest-own``) opens it beside the set's index and starts from a
store no warm-up reached.

Skipped where vLLM is not installed: ``.venv-vllm/bin/python -m pytest tests/test_fleet_bench.py``.
"""

from __future__ import annotations

import json

import pytest

from rest_spec.drafter.core.adaptive import SOURCE_NAMES

pytest.importorskip("vllm", reason="vLLM is not installed here: bash scripts/setup-vllm.sh, then use .venv-vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.bench]


def test_a_suffix_history_is_what_the_proposer_drafts_from(monkeypatch):
    """A run whose suffix cache holds the very requests it serves (their prompts and outputs, from a
    cold run before) drafts them almost whole: the history is in the cache vLLM's proposer reads,
    and a run without one starts from an empty cache (``benchmarks.harness.engines.suffix_history``)."""
    from benchmarks.harness.engines import run_job
    from benchmarks.harness.sets import humaneval_inputs
    from rest_spec.common.tokenizer import load_tokenizer
    from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    prompts = humaneval_inputs(load_tokenizer(None), 2)
    greedy = {"temperature": 0.0, "max_tokens": 24}
    job = {"model": str(hf_checkpoint()), "method": "suffix", "k": 4}
    (cold,) = run_job({**job, "runs": [{"prompts": prompts, "sampling": greedy}]})["runs"]
    history = [[p, o] for p, o in zip(prompts, cold["outputs"])]
    runs = [{"prompts": prompts, "sampling": greedy, "history": history}, {"prompts": prompts, "sampling": greedy}]
    runs[1]["history"] = []  # a fresh, empty cache: the first run's requests gone with it
    warm, fresh = run_job({**job, "runs": runs})["runs"]
    assert warm["outputs"] == fresh["outputs"] == cold["outputs"]
    assert warm["history"]["warmed"] == {"cached_requests": 2, "active_requests": 0}
    assert fresh["history"]["warmed"] == {"cached_requests": 0, "active_requests": 0}
    tokens = sum(map(len, cold["outputs"]))
    accepted = {name: run["spec"]["spec_decode_num_accepted_tokens"] for name, run in [("cold", cold), ("warm", warm)]}
    assert accepted["warm"] >= 0.6 * tokens and accepted["warm"] > accepted["cold"], accepted
    assert fresh["spec"]["spec_decode_num_accepted_tokens"] == accepted["cold"], (fresh["spec"], cold["spec"])


def test_fleet_benchmark_warms_both_methods_and_matches_plain(stdlib_index, tmp_path, monkeypatch):
    from benchmarks import fleet
    from benchmarks.harness import streams
    from rest_spec.common.tokenizer import load_tokenizer
    from rest_spec.datastore.format import read_manifest
    from tests.helpers import write_index

    tokenizer, manifest = load_tokenizer(None), read_manifest(stdlib_index)
    own = write_index(
        tmp_path / "own",
        [tokenizer.encode(f"    return sorted(numbers)[{i}]\n") for i in range(4)],
        manifest.tokenizer.vocab_size,
        fingerprint=manifest.tokenizer.fingerprint,
    )  # the model's own corpus, as benchmarks.own_corpus builds it, of this model's tokenizer
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # a third of an engine's start-up (test_vllm)
    cache = tmp_path / "warmup.json"
    monkeypatch.setattr(streams, "warmup_cache", lambda max_new_tokens: cache)  # decoded here, not read
    out = tmp_path / "fleet.json"
    argv = ["--sets", "code", "--replicas", "2", "--warmup", "2", "--prompts", "2", "--max-new-tokens", "8"]
    argv += ["--concurrency", "1", "--k", "4", "--no-measure-t", "--humaneval-index", str(stdlib_index)]
    argv += ["--methods", "suffix,rest,rest-copy,rest-own", "--own-index", f"code={own}"]
    assert fleet.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "fleet" and report["every_output_equals_plain"] and not report["failed_engines"]
    stream = report["streams"]["code"]
    assert stream["held_out"].endswith("prompts 101-102") and stream["prompts"] == 2
    assert stream["warmup"]["decoded_now"] == 2 and sum(stream["warmup"]["origins"]["2"].values()) == 2
    warm = json.loads(cache.read_text())["outputs"]
    assert len(warm) == 2 and all(0 < len(output) <= 8 for output in warm.values())

    fleet_ = stream["concurrency"]["1"]["2"]
    assert fleet_["shares"] == [1, 1] and not fleet_["failed"]
    assert fleet_["plain"]["outputs"] == fleet_["plain_again"]["equal_to_plain"] == 2
    block = fleet_["warmup"]["2"]
    for method in ("suffix", "rest", "rest-copy", "rest-own"):
        m = block[method]
        assert m["equal_to_plain"] == m["outputs"] == 2 and m["tokens_per_second"] > 0
        assert m["drafts"] >= 0 and len(m["replicas"]) == 2
        assert m["tokens_per_step"] == m["new_tokens"] / (m["new_tokens"] - m["accepted"]) >= 1
    assert set(block["rest_vs_suffix"]) == set(block["rest_copy_vs_suffix"]) == {"median", "overall"}
    assert set(block["rest_own_vs_suffix"]) == {"median", "overall"}
    assert report["config"]["own_index"] == {"code": str(own)}

    # each suffix replica's cache held its one warm-up request, then its held-out one too
    for replica in block["suffix"]["replicas"]:
        assert replica["suffix_cache"]["warmed"] == {"cached_requests": 1, "active_requests": 0}, replica
        assert replica["suffix_cache"]["at_end"]["cached_requests"] == 2, replica

    # the shared store: every warm-up output, as its server counts them, then the replicas' own
    # (the copying replicas add theirs to the server too)
    tokens = sum(len(output) for output in warm.values() if len(output) >= 2)
    for method in ("rest", "rest-copy"):
        store = block[method]["store"]
        assert store["warmup_outputs"] == 2 and store["warmup_tokens"] == tokens
        assert store["after_warmup"] == {"tokens": tokens, "add_output_calls": 2}, store
        # the first replica's output is stored once the second replica's run steps the engine on (the
        # last request of an engine's last run may end with the engine, not stored)
        assert store["at_end"]["add_output_calls"] >= 3 and store["at_end"]["tokens"] > tokens, store
        replicas = block[method]["replicas"]
        assert replicas[0]["outputs_added"] + replicas[1]["outputs_added"] >= 1
        assert block[method]["attribution"]["hindsight"]["steps"] >= 0
        assert set(block[method]["hindsight_per_source"]) <= set(SOURCE_NAMES)

    # the fleet with its own corpus: no warm-up output reached its store, its own outputs did
    store = block["rest-own"]["store"]
    assert store["warmup_outputs"] == 0 and store["after_warmup"] == {"tokens": 0, "add_output_calls": 0}, store
    assert store["at_end"]["add_output_calls"] >= 1, store


def test_history_sets_rests_chains_against_suffixs_on_the_same_contexts(tmp_path):
    """``benchmarks.history --versus-suffix`` without an engine: REST's replica and suffix's, both
    having served the same outputs, replayed on those same requests again. Suffix holds every step
    whole (its cache has the very outputs); REST's chain holds at least as much on most steps (the
    same outputs in its store), and where not, the tokens short are counted under REST's source."""
    from benchmarks.harness.fleet_replay import RestReplay, Shadowed, Tally, replay, run_fleet, suffix_replica
    from rest_spec.drafter.core.local import LocalDrafter
    from tests.helpers import CORPUS_VOCAB, synthetic_corpus, write_index

    docs = synthetic_corpus()
    index = write_index(tmp_path / "index", docs, CORPUS_VOCAB)
    examples = [(doc[:10], doc[10:60]) for doc in docs if len(doc) >= 60][:6]
    report = run_fleet("rest", 8, index, examples, examples, 2, 0.05, shadow=True)
    versus = report["versus_suffix"]
    assert versus["steps"] == report["steps"] - len(examples)  # every step but each request's first (the prefill's)
    assert 0.5 <= versus["at_least_suffix"] <= 1.0, versus
    short = sum(cell["tokens_short"] for cell in versus["by_rest_source"].values())
    assert short == round(versus["tokens_short_per_step"] * versus["steps"]), versus
    # the shadow changes nothing of REST's own replay
    with LocalDrafter.open(index, outputs_max_tokens=1_000_000) as base:
        for _, output in examples:
            base.add_output(output)
        alone, shadowed = Tally(), Tally()
        replay(RestReplay(8, base, ("index", "request", "outputs"), 0.05), list(enumerate(examples)), alone)
    with LocalDrafter.open(index, outputs_max_tokens=1_000_000) as base:
        for _, output in examples:
            base.add_output(output)
        rest = RestReplay(8, base, ("index", "request", "outputs"), 0.05)
        replay(Shadowed(rest, suffix_replica(8, examples)), list(enumerate(examples)), shadowed)
    assert alone.figures(0.05) == shadowed.figures(0.05)


def test_history_restart_empties_suffixs_caches_and_rest_recalls_its_store_and_calibrations(tmp_path):
    """``benchmarks.history --restart``: suffix's replicas restart with empty caches (as if cold),
    REST's reload the durable store of outputs and recall the calibrations they kept (their chains
    claim what the replicas that never restarted claim), or with ``forget`` start them anew; a fleet
    of more replicas than held-out requests replays each request once."""
    from benchmarks.harness.fleet_replay import run_fleet
    from tests.helpers import CORPUS_VOCAB, synthetic_corpus, write_index

    docs = synthetic_corpus()
    index = write_index(tmp_path / "index", docs, CORPUS_VOCAB)
    examples = [(doc[:10], doc[10:60]) for doc in docs if len(doc) >= 60][:6]
    warm, restarted, cold = (
        run_fleet("suffix", 8, index, served, examples, 2, restart=restart)
        for served, restart in ((examples, False), (examples, True), ([], False))
    )
    assert restarted == cold and warm["tokens_per_step"] > cold["tokens_per_step"]
    fresh, kept, reloaded, forgot = (
        run_fleet("rest-no-suffix", 8, index, served, examples, 2, restart=restart, forget=forget)
        for served, restart, forget in (([], False, False), (examples, False, False), (examples, True, False),
                                        (examples, True, True))
    )  # fmt: skip
    assert min(kept["tokens_per_step"], reloaded["tokens_per_step"]) > fresh["tokens_per_step"]
    claimed = {name: run["claims"]["claimed_over_accepted"] for name, run in (("kept", kept), ("reloaded", reloaded),
                                                                               ("forgot", forgot))}  # fmt: skip
    assert abs(claimed["reloaded"] - claimed["kept"]) < 0.2 * abs(claimed["forgot"] - claimed["kept"]), claimed
    many = run_fleet("suffix", 8, index, examples, examples, 64)
    assert round(many["tokens_per_step"] * many["steps"]) == sum(len(output) for _, output in examples)
