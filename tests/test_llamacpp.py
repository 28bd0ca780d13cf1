"""REST inside llama.cpp (``rest_spec.drafter.llamacpp.draft_model``) on the packaged SmolLM2 GGUF: greedy and
seeded sampling identical to llama.cpp without drafts, in process and over gRPC; the cost table;
the refusals. Skipped where llama-cpp-python is not installed (the ``llama`` extra)."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from rest_spec.common.tokenizer import (  # noqa: E402
    TokenizerMismatchError,
    load_tokenizer,
    packaged_smollm2,
    tokenizer_fingerprint,
    vocab_size,
)
from rest_spec.common.types import DraftConfig  # noqa: E402
from rest_spec.datastore.index import Datastore  # noqa: E402
from rest_spec.datastore.server import DatastoreServer, ServerConfig  # noqa: E402
from rest_spec.drafter.core.cost import VerifyCost  # noqa: E402
from rest_spec.drafter.core.local import LocalDrafter  # noqa: E402
from rest_spec.drafter.core.remote import RemoteDrafter  # noqa: E402
from rest_spec.drafter.llamacpp.draft_model import (  # noqa: E402
    RestDraftModel,
    RestLlama,
    llama_cost_key,
    llama_generate,
    load_or_measure_llama,
    measure_llama_cost,
    rest_llama,
)
from tests.helpers import DatastoreProcess, write_index  # noqa: E402

pytestmark = pytest.mark.llama

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(directory):\n",
]
NEW_TOKENS = 48
# one thread: llama.cpp's threads wait for each other spinning, and on a busy 2-core machine (CI's two
# pytest-xdist workers) two of them decoded 48 tokens in 30-100 s of CPU, one in 1.2 s
OPTIONS = {"n_ctx": 256, "n_threads": 1, "n_threads_batch": 1, "verbose": False}
# llama.cpp built with its llamafile matrix kernels rounds batches differently from one-token steps,
# so greedy near-ties can flip; the project's build (README) turns them off, and then drafts change nothing
EXACT_BATCHES = b"LLAMAFILE = 1" not in llama_cpp.llama_print_system_info()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(text) for text in PROMPTS]


@pytest.fixture(scope="module")
def plain():
    return llama_cpp.Llama(str(packaged_smollm2()), **OPTIONS)


@pytest.fixture(scope="module")
def references(plain, prompts):
    """llama.cpp's own greedy continuation of each prompt."""
    return [llama_generate(plain, ids, NEW_TOKENS).output_ids for ids in prompts]


@pytest.fixture(scope="module")
def index(tmp_path_factory, tokenizer, prompts, references):
    """A SmolLM2 index holding the prompts and their continuations (so drafts are long and right)
    among unrelated text."""
    noise = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)
    docs = [list(ids) + out for ids, out in zip(prompts, references)] + [noise]
    return write_index(
        tmp_path_factory.mktemp("llama") / "idx",
        docs,
        vocab_size(tokenizer),
        fingerprint=tokenizer_fingerprint(tokenizer),
    )


@pytest.fixture(scope="module")
def cost():
    """A real llama.cpp cost table, measured quickly (tests don't need its precision)."""
    llm = llama_cpp.Llama(str(packaged_smollm2()), logits_all=True, **OPTIONS)
    return measure_llama_cost(llm, sizes=(1, 2, 4, 8, 16), context_length=64, repeats=1, warmup=1)


def cheap_cost(cost: VerifyCost) -> VerifyCost:
    """``cost`` with batches priced like one token: every likely draft pays (drafts always run)."""
    flat = (cost.seconds[0],) * len(cost.sizes)
    return VerifyCost(cost.key, cost.context_length, cost.sizes, flat, flat)


def rest(drafter, cost: VerifyCost, **options) -> RestLlama:
    draft_model = RestDraftModel(drafter, cost=cost)
    return RestLlama(str(packaged_smollm2()), draft_model=draft_model, logits_all=True, **{**OPTIONS, **options})


def test_the_cost_table_is_measured_from_llama_cpp_and_keyed_by_file_threads_and_build(cost, plain):
    assert cost.sizes == (1, 2, 4, 8, 16) and all(s > 0 for s in cost.seconds)
    assert cost.chain_seconds == cost.seconds  # llama.cpp verifies chains
    key = llama_cost_key(plain)
    assert key.model == str(packaged_smollm2().resolve()) and "1x1threads" in key.device
    assert "Q4_1" in key.dtype and key.parameters > 100_000_000
    other = llama_cpp.Llama(str(packaged_smollm2()), **{**OPTIONS, "n_threads": 2})
    assert llama_cost_key(other) != key


def test_the_cost_is_measured_within_the_context_llama_cpp_python_allocated():
    """llama.cpp pads n_ctx (to 256 here); llama-cpp-python's buffers hold what was asked for."""
    llm = llama_cpp.Llama(str(packaged_smollm2()), logits_all=True, **{**OPTIONS, "n_ctx": 150})
    small = measure_llama_cost(llm, sizes=(1, 2, 32), repeats=1, warmup=0)
    assert small.context_length == 150 - 32 and len(small.seconds) == 3
    with pytest.raises(ValueError, match="no room"):
        measure_llama_cost(llm, sizes=(1, 2, 150), repeats=1, warmup=0)


def test_the_cost_table_is_cached_and_read_back(tmp_path, cost, plain, monkeypatch):
    llm = plain
    calls = []
    monkeypatch.setattr(
        "rest_spec.drafter.llamacpp.draft_model.measure_llama_cost", lambda llm: calls.append(1) or cost
    )
    first = load_or_measure_llama(llm, directory=tmp_path)
    again = load_or_measure_llama(llm, directory=tmp_path)
    assert first == again == cost and calls == [1]  # measured once, then read from disk
    (cached,) = (tmp_path / "verify-cost").iterdir()
    cached.write_text("{not json")
    assert load_or_measure_llama(llm, directory=tmp_path) == cost and calls == [1, 1]  # a bad file is re-measured


@pytest.mark.skipif(not EXACT_BATCHES, reason="llama.cpp built with llamafile kernels: batches round differently")
def test_greedy_output_is_llama_cpps_own_with_drafts_in_process(index, prompts, references, cost):
    with LocalDrafter.open(index) as drafter:
        llm = rest(drafter, cheap_cost(cost))
        for ids, reference in zip(prompts, references):
            result = llama_generate(llm, ids, NEW_TOKENS)
            assert result.output_ids == reference
            assert result.steps < len(reference) / 2  # long drafts were accepted
        assert llm.draft_model.stats.drafted > NEW_TOKENS


@pytest.mark.skipif(not EXACT_BATCHES, reason="llama.cpp built with llamafile kernels: batches round differently")
def test_greedy_output_is_llama_cpps_own_with_drafts_over_grpc(index, prompts, references, cost):
    with Datastore.open(index) as store, DatastoreServer(store, ServerConfig(port=0, workers=2)) as server:
        with RemoteDrafter(server.address) as drafter:
            llm = rest(drafter, cheap_cost(cost))
            results = [llama_generate(llm, ids, NEW_TOKENS) for ids in prompts]
    assert [r.output_ids for r in results] == references
    steps, tokens = sum(r.steps for r in results), sum(map(len, references))
    if llm.draft_model.scheduler.stats.fallbacks == 0:
        assert steps < tokens / 2  # long drafts from the server were accepted
    else:  # a loaded machine (CI's two workers): replies later than the deadline's 5 ms floor were not
        # waited for, and those steps drafted from the request's own text: still drafting, outputs unchanged
        assert steps < tokens and llm.draft_model.stats.drafted > 0


@pytest.mark.skipif(not EXACT_BATCHES, reason="llama.cpp built with llamafile kernels: batches round differently")
def test_seeded_sampling_draws_the_same_tokens_with_drafts(index, prompts, cost):
    """llama.cpp's sampler draws one token per position in order, drafts or not (one prompt: every
    step drafts, and verifying n tokens costs about n steps here)."""
    sampling = {"temp": 0.9, "top_k": 40, "top_p": 0.95}
    seed = 1
    plain = llama_cpp.Llama(str(packaged_smollm2()), seed=seed, **OPTIONS)
    with LocalDrafter.open(index) as drafter:
        llm = rest(drafter, cheap_cost(cost), seed=seed)
        expected = llama_generate(plain, prompts[0], NEW_TOKENS, **sampling).output_ids
        assert llama_generate(llm, prompts[0], NEW_TOKENS, **sampling).output_ids == expected
        assert llm.draft_model.stats.drafted > 0


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_a_frozen_or_killed_datastore_costs_a_few_steps_then_nothing(index, prompts, references, cost, fault):
    """The datastore (a real ``rest-datastore serve``) is stopped (SIGSTOP) or killed after the
    first prompt: the next generation waits at most a deadline on a few steps, then the breaker
    opens and the steps draft from the request's own text without asking; the output is unchanged."""
    server = DatastoreProcess("serve", "--index", index, "--host", "127.0.0.1", "--port", "0").wait()
    assert server.address, server.output
    try:
        with RemoteDrafter(server.address, timeout=30) as drafter:
            llm = rest(drafter, cheap_cost(cost))
            first = llama_generate(llm, prompts[0], NEW_TOKENS)
            scheduler = llm.draft_model.scheduler
            # the server answered most steps (some may have been later than the 5 ms deadline's floor:
            # CI's loaded machine, a fresh server paging its index in) and the breaker stayed closed
            before = scheduler.stats.fallbacks
            assert 2 * before <= scheduler.stats.steps and scheduler.breaker.closed, scheduler.stats.summary()
            if fault == "frozen":
                server.freeze()
            else:
                server.kill()
            second = llama_generate(llm, prompts[1], NEW_TOKENS)
            stats = scheduler.stats
            assert not scheduler.breaker.closed and stats.breaker_open_steps > 0
            late_or_failed = stats.fallbacks - before - stats.breaker_open_steps  # a few of them opened the breaker
            assert late_or_failed <= 5, stats.summary()
            assert max(stats.waits) < 10.0, stats.summary()  # no step waited out the RPC's 30 s timeout
            if EXACT_BATCHES:
                assert [first.output_ids, second.output_ids] == references
    finally:
        server.proc.send_signal(signal.SIGCONT)
        server.stop()


def test_a_draft_model_with_nothing_to_draft_backs_off_and_changes_nothing(
    tmp_path, tokenizer, prompts, references, cost
):
    unrelated = write_index(
        tmp_path / "idx", [[7, 8, 9] * 10], vocab_size(tokenizer), fingerprint=tokenizer_fingerprint(tokenizer)
    )
    with LocalDrafter.open(unrelated) as drafter:
        draft_model = RestDraftModel(drafter, cost=cost, sources=("index",))
        llm = RestLlama(str(packaged_smollm2()), draft_model=draft_model, logits_all=True, **OPTIONS)
        result = llama_generate(llm, prompts[0], NEW_TOKENS)
        stats = draft_model.stats
        if EXACT_BATCHES:
            assert result.output_ids == references[0]
        assert result.steps >= len(result.output_ids) and stats.drafted == 0
        # empty drafts back off: of the 40-odd steps, drafting was asked for only about log2 of them
        # each time the wait (1, 2, 4, 8 steps) ran out
        assert stats.calls >= NEW_TOKENS - 2 and stats.skipped > stats.calls * 2 / 3
        # a new request drafts at once
        skipped = stats.skipped
        llama_generate(llm, prompts[1], 2)
        assert stats.skipped == skipped


def test_attach_refuses_a_foreign_index_and_a_llama_without_every_logit(tmp_path, index, cost):
    foreign = write_index(tmp_path / "foreign", [[1, 2, 3]], 500)  # another tokenizer's fingerprint
    with LocalDrafter.open(foreign) as drafter:
        with pytest.raises(TokenizerMismatchError):
            rest_llama(packaged_smollm2(), drafter, **OPTIONS)
    with LocalDrafter.open(index) as drafter:
        draft_model = RestDraftModel(drafter)
        llm = llama_cpp.Llama(str(packaged_smollm2()), draft_model=draft_model, **{**OPTIONS, "n_ctx": 1024})
        with pytest.raises(ValueError, match="logits_all=True"):
            draft_model.attach(llm)
        with pytest.raises(RuntimeError, match="attach"):
            draft_model(np.array([1, 2, 3], np.intc))
        with pytest.raises(ValueError, match="draft_model"):
            RestDraftModel(drafter).attach(llm)


def test_rest_llama_checks_and_attaches(index, prompts, references, cost, tmp_path, monkeypatch):
    monkeypatch.setenv("REST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("rest_spec.drafter.llamacpp.draft_model.measure_llama_cost", lambda llm: cost)
    with LocalDrafter.open(index) as drafter:
        llm = rest_llama(packaged_smollm2(), drafter, config=DraftConfig(budget=16), **OPTIONS)
        assert isinstance(llm, RestLlama) and llm.draft_model.adaptive.cost.table == cost
        import rest_spec

        assert rest_spec.rest_llama is rest_llama and rest_spec.RestDraftModel is RestDraftModel
        text = llm(PROMPTS[0], max_tokens=8, temperature=0.0)["choices"][0]["text"]
    assert isinstance(text, str) and text


@pytest.fixture
def rest_generate(command):
    """``rest-generate ARGS`` (``python -m rest_spec.drafter``): its ``main`` in this process
    (conftest's ``command``); (status, stdout, stderr)."""
    from rest_spec.drafter.cli.rest_generate import main

    return lambda *args: command(main, args)


def test_the_cli_runs_llama_cpp_with_and_without_drafts(index, rest_generate):
    common = ["--engine", "llama.cpp", "--prompt", PROMPTS[0], "--max-new-tokens", "24", "--threads", "1", "--json"]
    status, plain, err = rest_generate(*common, "--no-draft")
    assert status == 0, err
    status, drafted, err = rest_generate(*common, "--max-depth", "8", "--datastore", str(index))
    assert status == 0, err
    plain_record, drafted_record = json.loads(plain), json.loads(drafted)
    assert plain_record["engine"] == "llama.cpp" and plain_record["steps"] >= plain_record["new_tokens"]
    if EXACT_BATCHES:
        assert drafted_record["output_ids"] == plain_record["output_ids"]


def test_the_cli_names_what_is_wrong(tmp_path, rest_generate):
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"\0" * 16)
    status, _, err = rest_generate("--engine", "llama.cpp", "--no-draft", "--prompt", "x", "--model", str(not_gguf))
    assert status == 1 and "FILE.gguf" in err
    status, _, err = rest_generate("--engine", "llama.cpp", "--no-draft", "--prompt", "x", "--overlap")
    assert status == 1 and "--overlap" in err
    status, _, err = rest_generate("--no-draft", "--prompt", "x", "--threads", "2")
    assert status == 1 and "--threads" in err
