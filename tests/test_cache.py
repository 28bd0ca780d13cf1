"""The on-disk caches (``common.cache``): the kernels, one directory per numba version, so
environments with different numba versions sharing the package never recompile each other's
kernels, and within it one per digest of the kernels' sources, so that no kernel runs a stale copy
of another module's kernel; what is converted from a GGUF file, once per file, and again where it
is damaged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numba
import pytest

from rest_spec.common.cache import (
    KERNEL_MODULES,
    PACKAGE_ROOT,
    STALE_AFTER_DAYS,
    converted,
    kernel_cache_dir,
    kernel_sources_digest,
    load_converted,
)
from rest_spec.drafter.core.kernels import KERNEL_GROUPS

# Compiles one kernel in a fresh interpreter and prints numba's cache directory: the structural
# check's token scan, the cheapest kernel of the package to compile (2 s; the trie's took 17).
COMPILE = """
import numpy as np
import numba
from rest_spec.datastore.format import _scan_tokens
counts = np.zeros(2, np.int64)
assert _scan_tokens(np.array([9, 1, 2, 9, 3, 9], np.uint16), 5, np.uint16(9), counts) == -1
assert counts.tolist() == [3, 1]
print(numba.config.CACHE_DIR)
"""


def compile_in(env_update: dict[str, str], tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(env_update)
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def cached_kernels(directory) -> list[str]:
    return sorted(path.name for path in directory.rglob("*.nbi"))


# ``compile_kernels`` over two spawned processes, on two of its modules (the cheapest: all of them
# take a minute of both cores), in a fresh interpreter.
COMPILE_IN_TWO = """
from rest_spec.drafter.core import kernels
kernels.KERNEL_GROUPS = ("rest_spec.datastore.bigram", "rest_spec.drafter.core.request_matcher")
kernels.compile_kernels(processes=2)
"""


@pytest.mark.cli
def test_kernels_compiled_in_two_processes_land_in_the_numba_versions_directory(tmp_path):
    """The kernels command's processes (spawned: fresh interpreters, each importing its module)
    write each module's kernels into the one directory of this numba version and sources."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(HOME=str(tmp_path), REST_CACHE_DIR=str(tmp_path / "tables"))
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_IN_TWO], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    versioned = tmp_path / ".cache" / "rest-spec" / "numba" / numba.__version__ / kernel_sources_digest()
    cached = cached_kernels(versioned)
    assert any(name.startswith("bigram.") for name in cached), cached
    assert any(name.startswith("request_matcher.") for name in cached), cached


def test_the_kernels_command_compiles_every_module_that_has_kernels():
    """Every kernel module with a ``compile_kernels`` of its own is one of the command's groups (a
    module missing there would compile at a server's start or a first draft instead)."""
    own = {
        "rest_spec." + module.removesuffix(".py").replace("/", ".")
        for module in KERNEL_MODULES
        if "def compile_kernels(" in (PACKAGE_ROOT / module).read_text()
    }
    assert own == set(KERNEL_GROUPS)


def test_the_kernels_command_refuses_no_processes():
    done = subprocess.run(
        [sys.executable, "-m", "rest_spec.drafter.core.kernels", "--processes", "0"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "--processes must be at least 1, got 0" in done.stderr


def test_every_kernel_module_is_in_the_digest():
    compiling = {
        path.relative_to(PACKAGE_ROOT).as_posix()
        for directory in ("build_index", "common", "datastore", "drafter", "proto")
        for path in (PACKAGE_ROOT / directory).rglob("*.py")
        if "numba_cached()" in path.read_text() and path.name != "cache.py"
    }
    assert compiling == set(KERNEL_MODULES)


def test_an_edit_of_any_kernel_module_moves_every_kernel_to_a_fresh_directory(tmp_path, monkeypatch):
    """numba checks a cached kernel against its own file only: ``index``'s kernels, which compile
    ``trie``'s ``_put_tree`` into themselves, would run the old one after an edit of ``trie.py``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "package"
    for module in KERNEL_MODULES:
        (root / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PACKAGE_ROOT / module, root / module)
    assert kernel_sources_digest(root) == kernel_sources_digest()
    before = kernel_cache_dir("0.0", root)
    with (root / "datastore" / "trie.py").open("a") as trie:
        trie.write("\n")
    after = kernel_cache_dir("0.0", root)
    assert (
        after != before
        and after.parent == before.parent == tmp_path / "home" / ".cache" / "rest-spec" / "numba" / "0.0"
    )
    (root / "drafter" / "core" / "merge.py").unlink()  # a missing module counts as empty, still its own digest
    assert kernel_sources_digest(root) not in {before.name, after.name}


def test_a_kernel_directory_unused_for_a_month_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    versioned = tmp_path / ".cache" / "rest-spec" / "numba" / "0.0"
    stale, recent = versioned / "0123456789abcdef", versioned / "core_from_before"
    for directory in (stale, recent):
        (directory / "sub").mkdir(parents=True)
    month_ago = time.time() - (STALE_AFTER_DAYS + 1) * 86400
    os.utime(stale, (month_ago, month_ago))
    current = kernel_cache_dir("0.0")
    os.utime(current, (month_ago, month_ago))  # its own age does not matter: it is in use, and marked so
    assert kernel_cache_dir("0.0") == current and current.stat().st_mtime > month_ago
    assert sorted(path.name for path in versioned.iterdir()) == sorted([current.name, recent.name])


@pytest.mark.cli
def test_numba_cache_dir_wins(tmp_path):
    printed = compile_in({"HOME": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path / "own")}, tmp_path)
    assert printed == str(tmp_path / "own")
    assert cached_kernels(tmp_path / "own") and not (tmp_path / ".cache").exists()


def test_a_conversion_is_made_once_per_file_and_again_for_a_replaced_file(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_MODELS_DIR", str(tmp_path / "models"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    calls = []

    def convert(out):
        calls.append(out)
        (out / "converted").write_bytes(source.read_bytes().upper())

    first = converted(source, "float32", convert)
    assert (first / "converted").read_bytes() == b"WEIGHTS" and first.parent.parent == tmp_path / "models"
    assert converted(source, "float32", convert) == first and len(calls) == 1  # read back, not converted again
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind
    source.write_bytes(b"other weights")  # the same name, another file: converted anew, elsewhere
    second = converted(source, "float32", convert)
    assert second != first and (second / "converted").read_bytes() == b"OTHER WEIGHTS" and len(calls) == 2


def test_a_failed_conversion_leaves_nothing_and_a_damaged_one_is_converted_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("REST_MODELS_DIR", str(tmp_path / "models"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")

    def broken(out):
        (out / "half").write_bytes(b"wei")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        converted(source, "tokenizer", broken)
    assert [p.name for p in (tmp_path / "models").rglob("*") if p.is_file()] == []  # no half conversion kept

    def convert(out):
        (out / "tokenizer.json").write_text('{"ok": true}')

    def load(directory):
        text = (directory / "tokenizer.json").read_text()
        if text != '{"ok": true}':
            raise ValueError(f"unreadable tokenizer.json: {text!r}")
        return text

    directory = converted(source, "tokenizer", convert)
    (directory / "tokenizer.json").write_text('{"o')  # damaged on disk
    assert load_converted(source, "tokenizer", convert, load) == '{"ok": true}'
    assert "does not load" in caplog.text and "converting model.gguf again" in caplog.text


@pytest.mark.model
def test_the_packaged_gguf_loads_from_its_conversion_as_it_loads_from_the_file(tmp_path, monkeypatch):
    """The converted tokenizer and weights are the GGUF's own: the fingerprint of the tokenizer
    transformers reads from the file, and every tensor of the file as llama.cpp's own reader
    (gguf-py) dequantizes it, q and k unpermuted as llama.cpp's converter permuted them (read so,
    not through transformers' GGUF loader again, which the conversion itself runs: 9 s, not 22);
    the second load reads the conversion."""
    import gguf
    import torch
    from transformers import AutoTokenizer

    from rest_spec.common.checkpoint import hf_checkpoint
    from rest_spec.common.tokenizer import load_tokenizer, packaged_smollm2, tokenizer_fingerprint
    from rest_spec.drafter.hf.model import load_model

    monkeypatch.setenv("REST_MODELS_DIR", str(tmp_path))
    path = packaged_smollm2()
    tokenizer = load_tokenizer(path)
    direct = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(direct)
    assert tokenizer.chat_template == direct.chat_template and tokenizer.eos_token == direct.eos_token
    model = load_model(path)
    assert model.config.name_or_path == str(hf_checkpoint(path))  # read from the conversion

    config = model.config
    file_tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}

    def from_the_file(name: str) -> torch.Tensor:
        tensor = file_tensors[name]
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        role = name.split(".")[-2]
        if role in heads:  # llama.cpp's converter interleaved the two rotary halves of each head's rows: undone
            n = heads[role]
            weights = weights.reshape(n, weights.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(weights.shape)
        return torch.from_numpy(weights.copy())

    state = model.state_dict()
    read = []
    for key, weights in state.items():
        name = names.get_name(key, try_suffixes=(".weight",))
        if key == "lm_head.weight" and config.tie_word_embeddings:
            assert name not in file_tensors and weights.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
            continue  # the embedding, tied: no tensor of its own in the file
        read.append(name)
        assert torch.equal(weights, from_the_file(name)), key
    assert sorted(read) == sorted(file_tensors)  # every tensor of the file, each once
