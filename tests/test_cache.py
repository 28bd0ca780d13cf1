"""The kernels' on-disk cache: one directory per numba version (``common.cache``), so environments
with different numba versions sharing the package never recompile each other's kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import pytest

pytestmark = pytest.mark.cli

# Compiles one kernel (the trie's) in a fresh interpreter and prints numba's cache directory.
COMPILE = """
import numpy as np
import numba
from rest_spec.datastore.trie import top_c_tree
tokens, parents, counts = top_c_tree(np.array([[1, 2, 9], [1, 3, 9]], np.uint16), 9, 8)
assert tokens.tolist() == [1, 2, 3] and parents.tolist() == [-1, 0, 0] and counts.tolist() == [2, 1, 1]
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


def test_kernels_are_cached_per_numba_version(tmp_path):
    printed = compile_in({"HOME": str(tmp_path), "REST_CACHE_DIR": str(tmp_path / "tables")}, tmp_path)
    versioned = tmp_path / ".cache" / "rest-spec" / "numba" / numba.__version__
    assert printed == str(versioned)
    assert any(name.startswith("trie._top_c_tree") for name in cached_kernels(versioned))


def test_numba_cache_dir_wins(tmp_path):
    printed = compile_in({"HOME": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path / "own")}, tmp_path)
    assert printed == str(tmp_path / "own")
    assert cached_kernels(tmp_path / "own") and not (tmp_path / ".cache").exists()
