"""rest-spec: retrieval-based speculative decoding (REST) for Hugging Face causal LMs.

Everything this distribution installs lives under ``rest_spec``: ``rest_spec.build_index`` (the
offline builder), ``rest_spec.datastore`` (the retrieval engine and its gRPC service),
``rest_spec.drafter`` (drafters, tree-attention verifier, decoding loop) and ``rest_spec.proto``
(the wire contract). The names below are the API a user starts from::

    from rest_spec import DraftConfig, LocalDrafter, generate, load_model, load_tokenizer

They are imported on first use, so ``import rest_spec`` alone loads neither torch nor numba.
"""

from __future__ import annotations

import importlib

from rest_spec import _moved

_moved.install()  # names the README documented before they moved (rest_spec._moved)

__version__ = "0.1.0"

_API = {
    "generate": "rest_spec.drafter.hf.generate",
    "rest_generate": "rest_spec.drafter.hf.plugin",
    "rest_llama": "rest_spec.drafter.llamacpp.draft_model",
    "RestDraftModel": "rest_spec.drafter.llamacpp.draft_model",
    "LocalDrafter": "rest_spec.drafter.core.local",
    "RemoteDrafter": "rest_spec.drafter.core.remote",
    "AdaptiveDrafter": "rest_spec.drafter.core.adaptive",
    "DraftConfig": "rest_spec.common.types",
    "OverlapConfig": "rest_spec.drafter.core.scheduler",
    "load_model": "rest_spec.drafter.hf.model",
    "load_tokenizer": "rest_spec.common.tokenizer",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'rest_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
