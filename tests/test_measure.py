"""Measuring t(n) on a real (tiny) model, its cache and the ``rest-measure-cost`` command."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rest_spec.drafter.cost import VerifyCost
from rest_spec.drafter.measure import cache_dir, load_or_measure, measure_verify_cost
from tests.helpers import tiny_causal_lm

MEASURE = dict(sizes=(1, 2, 4, 8), context_length=32, repeats=2, warmup=1)


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
    again = load_or_measure(model, directory=tmp_path, remeasure=True, sizes=(1, 3), context_length=16, repeats=1)
    assert again.sizes == (1, 3)
    assert VerifyCost.from_json(files[0].read_text()) == again
    files[0].write_text("{not json")  # a damaged cache file is measured again, not fatal
    assert load_or_measure(model, directory=tmp_path, **MEASURE).sizes == MEASURE["sizes"]
    stale = json.loads(files[0].read_text())
    del stale["chain_seconds"]  # written before chains were timed: measured again
    files[0].write_text(json.dumps(stale))
    assert load_or_measure(model, directory=tmp_path, **MEASURE).chain_seconds
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


def run_cli(*args: str, env_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rest_spec.drafter.measure", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "REST_CACHE_DIR": str(env_dir), "HF_HUB_OFFLINE": "1"},
    )


def test_measure_command_writes_the_cache(tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_causal_lm("llama").save_pretrained(model_dir)
    help_text = run_cli("--help", env_dir=tmp_path).stdout
    assert "--context-length" in help_text and "--sizes" in help_text
    done = run_cli(
        "--model",
        str(model_dir),
        "--sizes",
        "1,2,4",
        "--context-length",
        "16",
        "--repeats",
        "1",
        "--device",
        "cpu",
        env_dir=tmp_path / "cache",
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["sizes"] == [1, 2, 4] and printed["key"]["model"] == str(model_dir)
    written = list((tmp_path / "cache" / "verify-cost").glob("*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text()) == printed
    bad = run_cli("--sizes", "1,x", env_dir=tmp_path)
    assert bad.returncode == 2 and "--sizes must be comma-separated integers" in bad.stderr
    missing = run_cli("--model", str(tmp_path / "nope"), "--sizes", "1", env_dir=tmp_path)
    assert missing.returncode == 1 and "error:" in missing.stderr and "Traceback" not in missing.stderr
