"""The whole path on real parts: `build_index` -> index -> `rest-datastore serve` on a loopback port ->
the real SmolLM2 model drafting from it, local and remote, identical to `model.generate`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from benchmarks.harness.sets import humaneval_prompts
from rest_spec.build_index.build import BuildConfig, build
from rest_spec.build_index.corpora import CorpusSpec
from rest_spec.common.tokenizer import check_tokenizer, tokenizer_fingerprint, vocab_size
from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore
from rest_spec.drafter.cli.rest_generate import main as rest_generate_main
from rest_spec.drafter.core.corrected_cost import HEALED_BELOW
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.hf.generate import generate
from rest_spec.drafter.hf.measure import DEFAULT_SIZES
from tests.helpers import ONE_THREAD, brute_draft

pytestmark = [pytest.mark.model, pytest.mark.server]
NEW_TOKENS = 32  # on one thread of a Zen 3 core, a 64-token tree verifies in about 0.3 s
CLI_TOKENS = 16  # rest-generate's own tests (what it prints and sends): the first half of the reference


@pytest.fixture(scope="module")
def server_address(stdlib_server):
    """The session's real `rest-datastore serve` of the stdlib index (conftest.py)."""
    return stdlib_server.address


@pytest.fixture
def rest_generate(command, monkeypatch):
    """``rest_generate(*argv, cache=DIR)``: ``rest-generate``'s ``main`` in this process (conftest's
    ``command``), with ``$REST_CACHE_DIR`` set to ``cache`` where given."""

    def run(*argv, cache=None) -> tuple[int, str, str]:
        if cache is not None:
            monkeypatch.setenv("REST_CACHE_DIR", str(cache))
        return command(rest_generate_main, argv)

    return run


@pytest.fixture(scope="module")
def reference(smollm2):
    """`model.generate` greedy outputs for the first three HumanEval prompts."""
    model, tokenizer = smollm2
    out = {}
    for prompt in humaneval_prompts(3):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
        out[prompt] = (ids[0].tolist(), full[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.parametrize("where", ["local", pytest.param("remote", marks=pytest.mark.core)])
def test_greedy_output_identical_to_generate(smollm2, stdlib_index, server_address, reference, where):
    model, tokenizer = smollm2
    drafter = LocalDrafter.open(stdlib_index) if where == "local" else RemoteDrafter(server_address)
    with drafter:
        check_tokenizer(drafter, tokenizer_fingerprint(tokenizer))
        steps = tokens = 0
        for prompt_ids, expected in reference.values():
            result = generate(model, prompt_ids, drafter, max_new_tokens=NEW_TOKENS, config=DraftConfig(budget=64))
            assert result.output_ids == expected
            steps, tokens = steps + result.steps, tokens + len(result.output_ids)
    assert tokens / steps > 1.2  # drafts from the stdlib index are accepted on HumanEval code


def test_local_and_remote_drafters_return_identical_trees(stdlib_index, server_address, reference):
    config = DraftConfig(budget=64)
    with LocalDrafter.open(stdlib_index) as local, RemoteDrafter(server_address) as remote:
        contexts = [ids + out[:k] for ids, out in reference.values() for k in range(0, NEW_TOKENS, 7)]
        local_trees = [local.draft(c, config) for c in contexts]
        assert local_trees == [remote.draft(c, config) for c in contexts]
        assert local_trees == remote.draft_batch(contexts, config)
        assert sum(len(t) > 0 for t in local_trees) > len(contexts) // 2


def test_empty_index_answers_change_nothing(smollm2, tmp_path, reference):
    """An index that never matches (a corpus of one unrelated document, built in process as
    ``build_index --corpus FILE`` builds it) leaves decoding plain."""
    model, tokenizer = smollm2
    doc = tmp_path / "doc.txt"
    doc.write_text("zebra quokka")
    out = tmp_path / "tiny"
    build(BuildConfig(CorpusSpec(str(doc)), out, progress=False))
    prompt_ids, expected = next(iter(reference.values()))
    with LocalDrafter.open(out) as drafter:
        result = generate(model, prompt_ids, drafter, max_new_tokens=NEW_TOKENS)
    assert result.output_ids == expected and result.steps == len(expected)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_rest_generate_cli_json(stdlib_index, server_address, reference, tmp_path, rest_generate, where):
    """``rest-generate --json`` (its ``main``, in process) from an index directory or a server."""
    expected = next(iter(reference.values()))[1][:CLI_TOKENS]
    prompt = next(iter(reference))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": prompt}) + "\n")
    datastore = str(stdlib_index) if where == "local" else server_address
    status, out, err = rest_generate(
        "--datastore", datastore, "--prompts", prompts, "--max-new-tokens", CLI_TOKENS, "--budget", "64", "--json"
    )
    assert status == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["output_ids"] == expected
    assert record["new_tokens"] == len(expected) and record["steps"] < len(expected)
    assert record["mean_accepted"] == pytest.approx(record["new_tokens"] / record["steps"], abs=1e-4)
    drafting = record["drafting"]  # drafts prepared during the forwards (overlap is the default)
    assert drafting["steps"] == record["steps"] and drafting["fallbacks"] == 0
    assert 0 <= drafting["ready_share"] <= drafting["predicted_share"] <= 1
    assert 0 <= drafting["wait_ms_median"] <= drafting["wait_ms_p99"]


@pytest.mark.core
def test_drafts_equal_brute_force_on_the_real_index(stdlib_index):
    """Real SmolLM2 tokens of the whole standard library: trees equal an exhaustive scan."""
    config = DraftConfig(budget=64)
    rng = np.random.default_rng(0)
    with Datastore.open(stdlib_index) as store:
        docs = list(store.documents())
        long_docs = [doc for doc in docs if doc.size > 32]
        exact = 0
        for _ in range(40):
            doc = long_docs[rng.integers(len(long_docs))]
            end = int(rng.integers(16, doc.size))
            context = doc[end - 16 : end].astype(np.int64)
            # replace the older tokens by random ones so that match lengths vary from 2 to 16
            cut = int(rng.integers(0, 15))
            context[:cut] = rng.integers(0, store.vocab_size, cut)
            tree = store.draft(context, config)
            tokens, parents, counts, match_len, num_matches = brute_draft(
                docs, context, budget=64, max_depth=10, n_max=16, n_min=2, max_matches=store.max_candidates
            )
            assert (tree.match_len, tree.num_matches) == (match_len, num_matches)
            if tokens is not None:  # matches over the cap are sampled; the sampling has its own test
                assert (tree.tokens.tolist(), tree.parents.tolist(), tree.counts.tolist()) == (tokens, parents, counts)
                exact += 1
    assert exact >= 20


@pytest.mark.core
def test_rest_generate_adaptive_compare_equals_plain(stdlib_index, reference, smollm2_cost_dir, tmp_path):
    """The quick start's command, ``rest-generate --adaptive --compare``: merged sources sized by the
    cached verify cost (which the run may heal but never measures again), each prompt decoded without
    drafts too (at the table's fastest layout), both plain greedy decoding's output; the second prompt
    copies the first from the output store; one summary line."""
    prompt_ids, expected = next(iter(reference.values()))
    prompt = next(iter(reference))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((json.dumps({"prompt": prompt}) + "\n") * 2)
    cache = shutil.copytree(smollm2_cost_dir, tmp_path / "cache")
    table = {path.name: path.read_text() for path in (cache / "verify-cost").iterdir()}
    run = subprocess.run(
        [sys.executable, "-m", "rest_spec.drafter", "--datastore", str(stdlib_index), "--prompts", str(prompts),
         "--max-new-tokens", str(NEW_TOKENS), "--adaptive", "--compare", "--json", "-v"],
        capture_output=True, text=True, env={**os.environ, **ONE_THREAD, "REST_CACHE_DIR": str(cache)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    first, second = (json.loads(line) for line in run.stdout.strip().splitlines()[-2:])
    assert first["output_ids"] == second["output_ids"] == expected
    assert second["steps"] < first["steps"]  # the first output is in the store: the second copies it
    for record in (first, second):
        plain = record["without_drafts"]
        assert plain["same_output"] and plain["steps"] == len(expected) and plain["seconds"] > 0
    assert "no drafts: steps of" in run.stderr  # at the cached table's fastest layout
    check_healed_only(table, {path.name: path.read_text() for path in (cache / "verify-cost").iterdir()})
    [summary] = [line for line in run.stderr.splitlines() if line.startswith("REST (drafts from ")]
    assert f"{2 * len(expected)} tokens in " in summary and "the same output on 2 of 2 prompt(s)" in summary, summary


def check_healed_only(before: dict[str, str], after: dict[str, str]) -> None:
    """The cached tables ``after`` a run are those ``before`` it, not measured again: the run may
    only have healed them (``CorrectedCost.healed``: a size its steps priced clearly cheaper takes
    their price, confirmed; no size dearer, none added)."""
    assert after.keys() == before.keys()
    for name, text in before.items():
        old, new = VerifyCost.from_json(text), VerifyCost.from_json(after[name])
        assert (new.key, new.sizes, new.context_length) == (old.key, old.sizes, old.context_length)
        for n, was, now in zip(old.sizes, old.seconds, new.seconds):
            assert now == was or (now < HEALED_BELOW * was and n not in new.unconfirmed), (n, was, now)


def test_rest_generate_drafts_from_a_copy_of_a_fleets_store(
    stdlib_index, reference, smollm2_cost_dir, tmp_path, rest_generate
):
    """``--outputs-from`` (``rest-generate``'s ``main``, in process): the index in process, the store
    of outputs copied from a fleet's server that already holds the answer (another replica served
    it): fewer steps than with a fresh store of its own, the same output, and the output sent to the
    server."""
    from rest_spec.datastore.outputs import OutputStore
    from rest_spec.datastore.server import DatastoreServer, ServerConfig

    answer = next(iter(reference.values()))[1]
    expected = answer[:CLI_TOKENS]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": next(iter(reference))}) + "\n")
    cache = shutil.copytree(smollm2_cost_dir, tmp_path / "cache")
    command = ["--datastore", stdlib_index, "--prompts", prompts, "--max-new-tokens", CLI_TOKENS, "--adaptive",
               "--json"]  # fmt: skip
    with (
        Datastore.open(stdlib_index) as index,
        OutputStore(100_000, vocab_size=index.vocab_size) as outputs,
        DatastoreServer(index, ServerConfig(port=0, workers=2), outputs) as server,
    ):
        outputs.add(answer)
        runs = [rest_generate(*command, *extra, cache=cache) for extra in ([], ["--outputs-from", server.address])]
        for status, _, err in runs:
            assert status == 0, err
        fresh, copied = (json.loads(out.strip().splitlines()[-1]) for _, out, _ in runs)
        assert fresh["output_ids"] == copied["output_ids"] == expected
        assert copied["steps"] < fresh["steps"], (copied["steps"], fresh["steps"])
        assert [d.tolist() for d in outputs.documents()] == [answer, expected]  # sent by the copying run only


def test_rest_generate_adaptive_measures_the_cost_on_first_use(
    smollm2, stdlib_index, reference, tmp_path, rest_generate, caplog
):
    """With nothing cached, --adaptive measures the verify cost of the model it runs (every size of
    a full measurement) into $REST_CACHE_DIR before it generates; --no-draft measures nothing, and
    without a table it runs in PyTorch's layout (no "no drafts: steps of" line). ``rest-generate``'s
    ``main``, in process. The model measured is a model directory, as a user names one with
    --model: a randomly initialised one-layer Llama holding SmolLM2's tokenizer (so that the stdlib
    index serves it), whose table the same code measures in seconds (SmolLM2's takes two minutes
    at one thread); greedy, it decodes as its own ``model.generate``. --no-draft runs the packaged
    SmolLM2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = smollm2
    prompt_ids, expected = next(iter(reference.values()))
    prompt = next(iter(reference))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    tiny = LlamaForCausalLM(config).eval()
    model_dir = tmp_path / "tiny-model"
    tiny.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        tiny_expected = tiny.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
    status, out, err = rest_generate(
        "--datastore", stdlib_index, "--model", model_dir, "--prompt", prompt, "--max-new-tokens", "8", "--adaptive",
        "--json", cache=tmp_path / "cache",
    )  # fmt: skip
    assert status == 0, err
    assert json.loads(out.strip().splitlines()[-1])["output_ids"] == tiny_expected[0, ids.shape[1] :].tolist()
    [table] = (tmp_path / "cache" / "verify-cost").glob("*.json")
    measured = VerifyCost.from_json(table.read_text())
    assert measured.sizes == DEFAULT_SIZES and measured.key.parameters == tiny.num_parameters()

    caplog.clear()
    status, out, err = rest_generate(
        "--no-draft", "--prompt", prompt, "--max-new-tokens", "8", "--json", "-v", cache=tmp_path / "empty"
    )
    assert status == 0, err
    assert json.loads(out.strip().splitlines()[-1])["output_ids"] == expected[:8]
    # -v: the project's records at INFO and above reach the test's log capture (not stderr: pytest's handlers hold it)
    assert "loaded " in caplog.text and "no drafts: steps of" not in caplog.text
    assert not (tmp_path / "empty").exists()
