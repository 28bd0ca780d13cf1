"""Fixtures shared across test modules: the real SmolLM2 model and a real python-stdlib index,
each built once per session (they take tens of seconds)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): the packaged SmolLM2-135M-Instruct, fp32 on CPU, eval mode."""
    from rest_spec.common.tokenizer import load_tokenizer
    from rest_spec.drafter.model import load_model

    model = load_model(None)
    return model, load_tokenizer(None)


@pytest.fixture(scope="session")
def stdlib_index(tmp_path_factory):
    """An index of this Python's standard library built by the real `build_index` CLI."""
    out = tmp_path_factory.mktemp("indexes") / "python-stdlib"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rest_spec.build_index",
            "--corpus",
            "python-stdlib",
            "--out",
            str(out),
            "--workers",
            "2",
            "--quiet",
        ],
        check=True,
    )
    return out


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models and tensors: on a busy 2-core machine torch's intra-op threads cost far more
    than they save (SmolLM2 greedy, 16 tokens: 29 s with 2 threads, 2.2 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
