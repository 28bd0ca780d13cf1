"""REST for llama.cpp: a ``llama_cpp`` draft model that drafts from this project's datastore.

llama-cpp-python's ``Llama.generate`` asks its ``draft_model`` for tokens after every step,
evaluates them with the pending token in one batch, and keeps the prefix its own sampler agrees
with: it verifies chains, never trees. On a CPU a batch of n tokens costs nearly n one-token steps
for a small model (SmolLM2-135M Q4_1 on 2 threads: t(2) 1.8, t(4) 2.5, t(8) 4.0 one-token steps),
so a draft of fixed size loses time; llama.cpp's own prompt lookup (10 tokens) runs slower than no
drafting at all.

``RestDraftModel`` drafts as ``AdaptiveDrafter`` does (the index, in process or over gRPC, the
request's own text and recent outputs, merged into one tree scored by calibrated acceptance) and
hands llama.cpp the root path whose expected tokens per second is highest under llama.cpp's own
t(n) -- nothing when no path pays. t(n) is measured once per model file, thread counts and machine
with the ``Llama`` it drafts for (``load_or_measure_llama``) and cached beside the transformers
table. The accepted tokens reach the drafter as the next call's context, like every other loop.
Drafts go through ``drafter.core.scheduler.DraftScheduler`` as in the other engines: a datastore reply
may keep a step waiting a fraction of a step's time at most, and a datastore that stops answering
opens the circuit breaker, so a frozen or dead one costs a few steps, then nothing.

    llm = rest_llama("model.gguf", LocalDrafter.open("indexes/python-stdlib"), n_threads=2)
    llm("def fibonacci(n):", max_tokens=128, temperature=0)

Greedy output is llama.cpp's own greedy decoding, except where its batched kernels round a logit
differently from its one-token kernels and a near-tie flips (llama.cpp's prompt lookup shows the
same effect). Sampling is llama.cpp's own sampler: it draws one token per position, in order, so a
seeded generation draws the same tokens with drafts as without.

Needs ``llama-cpp-python`` (the ``llama`` extra; see the README for a portable build).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rest_spec.common.types import DraftConfig, DraftTree
from rest_spec.drafter.core.adaptive import SOURCES, AdaptiveDrafter
from rest_spec.drafter.core.corrected_cost import CorrectedCost
from rest_spec.drafter.core.cost import CostKey, VerifyCost, check_sizes
from rest_spec.drafter.core.cost_cache import cached_cost, check_timing
from rest_spec.drafter.core.protocol import Drafter
from rest_spec.drafter.core.scheduler import DraftScheduler, OverlapConfig

try:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaDraftModel
except ImportError:  # the optional ``llama`` extra

    class LlamaDraftModel:  # type: ignore[no-redef]
        """Stands in for llama_cpp's base class so this module imports without it."""

    llama_cpp = None

if TYPE_CHECKING:
    from llama_cpp import Llama

log = logging.getLogger(__name__)

LLAMA_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
LLAMA_CONTEXT_LENGTH = 256
_HEADER_BYTES = 1 << 20  # a GGUF file's metadata and tensor table: enough to tell two files apart


def require_llama_cpp() -> None:
    """``ImportError`` naming the install when llama-cpp-python is missing."""
    if llama_cpp is None:
        raise ImportError(
            "llama.cpp support needs llama-cpp-python: pip install 'rest-spec[llama]' (it builds llama.cpp "
            "from source; see the README for a portable build)"
        )


# ---- llama.cpp's verification cost ---------------------------------------------------------------


def llama_cost_key(llm: Llama) -> CostKey:
    """What a measurement on ``llm`` is valid for: the model file (path, and size plus a hash of its
    first MiB, so a replaced file differs), llama.cpp's version and build features, the machine and both thread counts
    (one-token steps run on ``n_threads``, batches on ``n_threads_batch``), and the file's type."""
    path = Path(llm.model_path).resolve()
    with path.open("rb") as file:
        header = hashlib.sha256(file.read(_HEADER_BYTES)).hexdigest()[:16]
    params = llm.context_params
    build = hashlib.sha256(llama_cpp.llama_print_system_info()).hexdigest()[:8]  # CPU features compiled in
    return CostKey(
        model=str(path),
        revision=f"{path.stat().st_size}-{header}",
        parameters=int(llama_cpp.llama_model_n_params(llm.model)),
        device=f"llama.cpp-{llama_cpp.__version__}-{build}-{platform.machine()}-"
        f"{params.n_threads}x{params.n_threads_batch}threads",
        dtype=_model_description(llm),
    )


def _model_description(llm: Llama) -> str:
    """llama.cpp's one-line description of the model ("llama 135M Q4_1")."""
    import ctypes

    buffer = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llm.model, buffer, len(buffer))
    return buffer.value.decode("utf-8", "replace")


def measure_llama_cost(
    llm: Llama,
    *,
    sizes: Sequence[int] = LLAMA_SIZES,
    context_length: int = LLAMA_CONTEXT_LENGTH,
    repeats: int = 5,
    warmup: int = 2,
) -> VerifyCost:
    """Median wall time of ``llm.eval`` of n tokens on top of ``context_length`` cached tokens, for
    each n in ``sizes``: one verification step of a chain of n - 1 drafted tokens, as
    ``Llama.generate`` runs it (all positions' logits kept when a draft model is set). The context is
    cut back after every run, and ``llm`` is reset at the end (its next generation starts afresh)."""
    check_sizes(sizes)
    check_timing(repeats, warmup, context_length)
    n_ctx = llm.context_params.n_ctx  # what llama-cpp-python sized its buffers for (llama.cpp may pad its own)
    if n_ctx - sizes[-1] < context_length:
        log.info("n_ctx %d: timing on a context of %d tokens, not %d", n_ctx, n_ctx - sizes[-1], context_length)
        context_length = n_ctx - sizes[-1]
    if context_length < 1:
        raise ValueError(f"n_ctx {n_ctx} leaves no room for a context under {sizes[-1]} tokens")
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()
    evaluate = functools.partial(llama_cpp.Llama.eval, llm)  # every position's logits, as a draft step
    llm.reset()
    evaluate(rng.integers(vocab, size=context_length).tolist())
    seconds = []
    try:
        for n in sizes:
            tokens = rng.integers(vocab, size=n).tolist()
            times = []
            for _ in range(warmup + repeats):
                llm.n_tokens = context_length  # eval drops the cache past n_tokens first
                start = time.perf_counter()
                evaluate(tokens)
                times.append(time.perf_counter() - start)
            seconds.append(statistics.median(times[warmup:]))
            log.info("llama.cpp t(%d) = %.3f ms", n, 1e3 * seconds[-1])
    finally:
        llm.reset()
    return VerifyCost(llama_cost_key(llm), context_length, tuple(int(n) for n in sizes), tuple(seconds), tuple(seconds))


def load_or_measure_llama(llm: Llama, *, directory: Path | None = None, remeasure: bool = False) -> VerifyCost:
    """llama.cpp's cost for ``llm``, cached like the transformers table (``drafter.hf.measure``);
    measured (about half a minute for a small model) when missing or when ``remeasure``."""
    return cached_cost(llama_cost_key(llm), lambda: measure_llama_cost(llm), directory=directory, remeasure=remeasure)


# ---- the draft model -----------------------------------------------------------------------------


def check_vocabulary(llm: Llama, drafter: Drafter) -> None:
    """``ValueError`` unless ``llm``'s token ids mean what the datastore's do: the tokenizer read from
    the same GGUF file must have the index's fingerprint (``common.tokenizer.check_tokenizer``)
    and the same token text for every id as llama.cpp's own vocabulary."""
    from rest_spec.common.tokenizer import check_tokenizer, load_tokenizer, tokenizer_fingerprint

    tokenizer = load_tokenizer(llm.model_path)
    check_tokenizer(drafter, tokenizer_fingerprint(tokenizer))
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    count = llm.n_vocab()
    ours = tokenizer.convert_ids_to_tokens(list(range(count)))
    for token, text in enumerate(ours):
        theirs = llama_cpp.llama_vocab_get_text(vocab, token).decode("utf-8", "replace")
        if theirs != text:
            raise ValueError(
                f"llama.cpp's vocabulary differs from the tokenizer read from {llm.model_path}: id {token} is "
                f"{theirs!r} there and {text!r} here"
            )


@dataclasses.dataclass
class DraftStats:
    """What a ``RestDraftModel`` did: ``calls`` (one per verification step after a prompt's first),
    of which ``skipped`` drafted nothing without asking (backing off), ``drafted`` tokens handed to
    llama.cpp, seconds spent drafting."""

    calls: int = 0
    skipped: int = 0
    drafted: int = 0
    seconds: float = 0.0


class RestDraftModel(LlamaDraftModel):
    """A ``llama_cpp.llama_speculative.LlamaDraftModel`` drafting from ``drafter`` (a
    ``LocalDrafter`` or ``RemoteDrafter``; ``SourceDrafter`` for the outputs source) with the request's
    text and recent outputs, chains sized by llama.cpp's measured cost (see the module docstring).

    Give it to ``Llama(..., draft_model=..., logits_all=True)``, then ``attach(llm)`` (or build both with
    ``rest_llama``): that checks the vocabularies and loads or measures the cost. ``config`` caps
    the candidates (budget per source, ``max_depth`` the longest chain). One per ``Llama``; not
    thread-safe. ``add_output(tokens)`` stores a finished generation for later drafts."""

    def __init__(
        self,
        drafter: Drafter,
        *,
        cost: VerifyCost | None = None,
        config: DraftConfig = DraftConfig(),
        sources: Sequence[str] = SOURCES,
        suffixes: Sequence[int] = (),
    ) -> None:
        require_llama_cpp()
        self.drafter, self.config, self.stats = drafter, config, DraftStats()
        self._options = {"config": config, "sources": tuple(sources), "suffixes": tuple(suffixes)}
        self.adaptive: AdaptiveDrafter | None = None
        self.scheduler: DraftScheduler | None = None
        self._context_length = 0  # see __call__
        self._request = 0  # the number of the request being decoded (llama.cpp runs one at a time)
        self.last_chain = np.zeros(0, np.intc)
        self._last_tree = DraftTree.empty()  # the chain last handed out, as the scheduler drafted it
        if cost is not None:
            self.use_cost(cost)

    def use_cost(self, cost: VerifyCost, *, cached: bool = False) -> None:
        """Size chains by ``cost`` (a measurement of the ``Llama`` this drafts for), corrected by the
        step times observed from then on (``observe``); ``cached``: the table is the cache's, which
        ``close`` then replaces with the corrected one (``AdaptiveDrafter``'s ``cache_healed``)."""
        corrected = CorrectedCost(cost, pads=False)  # llama.cpp runs exactly the tokens it is given
        if self.adaptive is None:
            self.adaptive = AdaptiveDrafter(
                self.drafter, cost=corrected, chains=True, cache_healed=cached, **self._options
            )
            self.adaptive.warm_up()  # its kernels loaded with the model, not in the first request
            # no overlap: llama.cpp's threads take every core while it evaluates
            self.scheduler = DraftScheduler(self.adaptive, self.config, OverlapConfig(enabled=False), cost.seconds[0])
        else:
            self.adaptive.cost, self.adaptive.cache_healed = corrected, cached

    def observe(self, tokens: int, seconds: float) -> None:
        """One evaluation of ``tokens`` tokens (a pending token and the first ``tokens - 1`` of the
        chain last drafted) took ``seconds``: the scheduler feeds it to the cost (the table is timed
        on one context length, with caches warm, and real steps run on other contexts, between other
        work: ``drafter.core.corrected_cost.CorrectedCost``) and the datastore's deadlines."""
        if self.scheduler is not None:
            verified = self._last_tree.first(tokens - 1)
            self.scheduler.verified(seconds, [verified])

    def attach(self, llm: Llama, *, check: bool = True, remeasure: bool = False) -> VerifyCost:
        """Ready this model to draft for ``llm`` (built with ``draft_model=self``): check that its
        vocabulary is the index's (unless ``check`` is False), then load or measure its cost."""
        if llm.draft_model is not self:
            raise ValueError("attach the Llama built with draft_model=<this RestDraftModel>")
        if llm.scores.shape[0] < llm.context_params.n_ctx:
            # llama-cpp-python keeps every position's logits with a draft model, in a buffer it
            # sizes by logits_all: without it, a context past n_batch tokens fails mid-generation
            raise ValueError("build the Llama with logits_all=True: drafts need every position's logits")
        if check:
            check_vocabulary(llm, self.drafter)
        cost = load_or_measure_llama(llm, remeasure=remeasure)
        self.use_cost(cost, cached=True)
        return cost

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        """The chain to verify after ``input_ids`` (the committed tokens and the pending one).

        Whether to draft at all is the scheduler's rule, every engine's (``DraftScheduler.step``):
        a step that drafted is weighed by its chain's expected gain against its verification (the
        corrected cost) and the drafting's own time (a millisecond or so, a tenth of a one-token
        step of a small model), so where drafts keep coming back empty or do not pay, the next 1,
        then 2, 4 ... steps draft nothing. A new request starts over: the last one has ended."""
        if self.adaptive is None:
            raise RuntimeError("RestDraftModel has no verify cost: call attach(llm) first")
        self.stats.calls += 1
        ended = ()
        if len(input_ids) <= self._context_length:  # not a continuation: a new request
            ended, self._request = (self._request,), self._request + 1
        self._context_length = len(input_ids)
        start, skipped = time.perf_counter(), self.scheduler.stats.skipped
        (tree,) = self.scheduler.step([input_ids], [self._request], ended=ended)
        if self.scheduler.stats.skipped > skipped:
            self.stats.skipped += 1
        else:
            self.stats.drafted += len(tree)
            self.stats.seconds += time.perf_counter() - start
        self.last_chain, self._last_tree = tree.tokens.astype(np.intc), tree
        return self.last_chain

    def drafted(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` are a pending token and (a prefix of) the chain last drafted: an
        evaluation that verifies a draft, where every position is sampled."""
        chain = self.last_chain
        return 1 < len(tokens) <= 1 + len(chain) and np.array_equal(tokens[1:], chain[: len(tokens) - 1])

    def add_output(self, tokens: Sequence[int]) -> int:
        """Store a finished generation (its new tokens) in the datastore's output store."""
        return self.drafter.add_output(tokens)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.adaptive is not None:
            self.adaptive.close()  # caches the corrected cost where it came from the cache; closes the drafter
        else:
            self.drafter.close()


if llama_cpp is not None:

    class RestLlama(llama_cpp.Llama):
        """A ``Llama`` drafting with a ``RestDraftModel`` that computes a prompt's logits at its last
        position only, as llama.cpp does without a draft model. (llama-cpp-python keeps every
        position's logits once a draft model is set, the prompt's too: for a prompt of 150 tokens
        that is 150 output-layer products, more than ten one-token steps of SmolLM2-135M.)"""

        draft_model: RestDraftModel

        def eval(self, tokens: Sequence[int]) -> None:
            if len(tokens) > 1 and not self.draft_model.drafted(tokens):
                self._logits_all = False
                try:
                    super().eval(tokens[:-1])
                finally:
                    self._logits_all = True
                tokens = tokens[-1:]
            start = time.perf_counter()
            super().eval(tokens)
            self.draft_model.observe(len(tokens), time.perf_counter() - start)


def rest_llama(model_path: str | Path, drafter: Drafter, *, config: DraftConfig = DraftConfig(), **llama_options):
    """A ``RestLlama`` (a ``llama_cpp.Llama``) for ``model_path`` whose speculative decoding drafts from
    ``drafter`` (``RestDraftModel``, attached: vocabularies checked, cost loaded or measured);
    ``llama_options`` go to ``Llama`` (``n_threads``, ``n_ctx``, ...; ``verbose`` defaults to False)."""
    require_llama_cpp()
    draft_model = RestDraftModel(drafter, config=config)
    llama_options.setdefault("verbose", False)
    llm = RestLlama(str(model_path), draft_model=draft_model, logits_all=True, **llama_options)
    draft_model.attach(llm)
    return llm


@dataclasses.dataclass(frozen=True)
class LlamaGeneration:
    """One greedy generation through ``Llama.generate``: the new tokens (the end-of-generation token
    not included), wall seconds, and verification steps (llama.cpp evaluations after the prompt's)."""

    output_ids: list[int]
    seconds: float
    steps: int

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return len(self.output_ids) / self.steps if self.steps else 0.0


def llama_generate(llm: Llama, prompt: Sequence[int], max_new_tokens: int, **sampling: Any) -> LlamaGeneration:
    """Decode up to ``max_new_tokens`` after ``prompt`` (token ids) with ``llm.generate``, greedy
    unless ``sampling`` says otherwise (``temp``, ``top_k``, ...), stopping at an end-of-generation
    token. The prompt is evaluated afresh (no reuse of a previous generation's cache), so timings of
    different ``Llama`` objects compare. Steps are counted from ``llm.eval`` calls."""
    sampling.setdefault("temp", 0.0)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    steps = 0
    evaluate = llm.eval

    def counted_eval(tokens: Sequence[int]) -> None:
        nonlocal steps
        steps += 1
        evaluate(tokens)

    output: list[int] = []
    llm.reset()
    llm.eval = counted_eval
    start = time.perf_counter()
    try:
        for token in llm.generate(list(prompt), reset=True, **sampling):
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            output.append(int(token))
            if len(output) >= max_new_tokens:
                break
    finally:
        seconds = time.perf_counter() - start
        del llm.eval
    return LlamaGeneration(output, seconds, steps)
