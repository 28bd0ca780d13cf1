"""The whole path on real parts: `build_index` -> index -> `rest-datastore serve` on a loopback port ->
the real SmolLM2 model drafting from it, local and remote, identical to `model.generate`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from benchmarks.common import humaneval_prompts
from rest_spec.common.tokenizer import check_tokenizer, tokenizer_fingerprint
from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore
from rest_spec.drafter.generate import generate
from rest_spec.drafter.local import LocalDrafter
from rest_spec.drafter.remote import RemoteDrafter
from tests.helpers import brute_draft

pytestmark = pytest.mark.slow
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def server_address(stdlib_index):
    """A real `rest-datastore serve` process on a free loopback port."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rest_spec.datastore",
            "serve",
            "--index",
            str(stdlib_index),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    match = re.search(r"(127\.0\.0\.1:\d+)", line)
    assert match, f"server did not print its address: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
    yield match.group(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


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


@pytest.mark.parametrize("where", ["local", "remote"])
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
    """An index that never matches (a corpus of one unrelated document) leaves decoding plain."""
    model, tokenizer = smollm2
    doc = tmp_path / "doc.txt"
    doc.write_text("zebra quokka")
    out = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, "-m", "rest_spec.build_index", "--corpus", str(doc), "--out", str(out), "--quiet"], check=True
    )
    prompt_ids, expected = next(iter(reference.values()))
    with LocalDrafter.open(out) as drafter:
        result = generate(model, prompt_ids, drafter, max_new_tokens=NEW_TOKENS)
    assert result.output_ids == expected and result.steps == len(expected)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_rest_generate_cli_json(stdlib_index, server_address, reference, tmp_path, where):
    prompt_ids, expected = next(iter(reference.values()))
    prompt = next(iter(reference))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": prompt}) + "\n")
    datastore = str(stdlib_index) if where == "local" else server_address
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rest_spec.drafter",
            "--datastore",
            datastore,
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--budget",
            "64",
            "--json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout.strip().splitlines()[-1])
    assert record["output_ids"] == expected
    assert record["new_tokens"] == len(expected) and record["steps"] < len(expected)
    assert record["mean_accepted"] == pytest.approx(record["new_tokens"] / record["steps"], abs=1e-4)
    drafting = record["drafting"]  # drafts prepared during the forwards (overlap is the default)
    assert drafting["steps"] == record["steps"] and drafting["fallbacks"] == 0
    assert 0 <= drafting["ready_share"] <= drafting["predicted_share"] <= 1
    assert 0 <= drafting["wait_ms_median"] <= drafting["wait_ms_p99"]


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


def test_rest_generate_adaptive_cli_equals_plain(stdlib_index, reference, tmp_path):
    """--adaptive: merged sources sized by the verify cost, measured on first use into
    $REST_CACHE_DIR; the output is still plain greedy decoding, and a second prompt runs."""
    prompt_ids, expected = next(iter(reference.values()))
    prompt = next(iter(reference))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((json.dumps({"prompt": prompt}) + "\n") * 2)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rest_spec.drafter",
            "--datastore",
            str(stdlib_index),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--adaptive",
            "--json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "REST_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert run.returncode == 0, run.stderr
    first, second = (json.loads(line) for line in run.stdout.strip().splitlines()[-2:])
    assert first["output_ids"] == second["output_ids"] == expected
    assert second["steps"] < first["steps"]  # the first output is in the store: the second copies it
    assert list((tmp_path / "cache" / "verify-cost").glob("*.json"))

    # --no-draft runs at the fastest layout of the table --adaptive cached; the output is the same
    for cache, layout in ((tmp_path / "cache", True), (tmp_path / "empty", False)):
        plain = subprocess.run(
            [sys.executable, "-m", "rest_spec.drafter", "--no-draft", "--prompt", prompt, "--max-new-tokens",
             str(NEW_TOKENS), "--json", "-v"],
            capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "REST_CACHE_DIR": str(cache)},
        )  # fmt: skip
        assert plain.returncode == 0, plain.stderr
        assert json.loads(plain.stdout.strip().splitlines()[-1])["output_ids"] == expected
        assert ("no drafts: steps of" in plain.stderr) is layout, plain.stderr
