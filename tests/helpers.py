"""Helpers shared by the test modules: brute-force oracles, small real indexes, tiny real models."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    StoppingCriteria,
)
from transformers.generation.streamers import BaseStreamer

from rest_spec.build_index.writer import IndexWriter
from rest_spec.common.types import DraftConfig, DraftTree, IndexInfo

# ---- indexes ----------------------------------------------------------------------------------


def write_index(
    path: Path,
    docs: Iterable[Sequence[int]],
    vocab_size: int,
    shard_tokens: int = 1 << 20,
    fingerprint: str = "sha256:test",
) -> Path:
    """A real index of ``docs`` at ``path`` (replacing any), written by the real ``IndexWriter``;
    ``fingerprint`` names its tokenizer (a real one's to serve a real model)."""
    with IndexWriter(
        path,
        tokenizer_name="test-tok",
        tokenizer_fingerprint=fingerprint,
        vocab_size=vocab_size,
        shard_tokens=shard_tokens,
        overwrite=True,
    ) as writer:
        writer.add_documents(docs)
        writer.finish()
    return path


CORPUS_VOCAB = 500
UNSEEN = CORPUS_VOCAB - 1  # a valid token id the corpus never uses: a context ending in it matches nothing
MAX_CONTEXT = 64


def tiny_bpe_tokenizer(path: Path, texts: Sequence[str]) -> Path:
    """A byte-level BPE (any text encodes) trained on ``texts``, saved at ``path`` the way models
    ship tokenizers; returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"], show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


def synthetic_corpus() -> list[list[int]]:
    """200 documents of recurring phrases and noise (deep, branching matches); deterministic."""
    rng = np.random.default_rng(7)
    phrases = [rng.integers(0, UNSEEN, size=rng.integers(4, 16)).tolist() for _ in range(30)]
    docs = []
    for _ in range(200):
        doc: list[int] = []
        while len(doc) < rng.integers(20, 120):
            doc += phrases[rng.integers(len(phrases))] if rng.random() < 0.7 else rng.integers(0, UNSEEN, 3).tolist()
        docs.append(doc)
    return docs


def contexts_from(docs, count, seed=0):
    """Slices of the corpus (so they match) of 1..40 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        doc = docs[rng.integers(len(docs))]
        end = int(rng.integers(1, len(doc) + 1))
        out.append(doc[max(0, end - int(rng.integers(1, 40))) : end])
    return out


def brute_draft(docs, context, *, budget, max_depth, n_max, n_min, max_matches=None):
    """REST's draft by exhaustive scan: the longest context suffix (n_max..n_min) found inside a
    document, every continuation up to the document end, prefix counts, top-budget by
    (-count, depth, path), BFS order. Returns (tokens, parents, counts, match_len, num_matches);
    with ``max_matches``, returns no tree (only the match) when more positions match than that.

    Matches are found by checking every position holding the last context token, then filtering
    backwards one token at a time; documents are joined with -1 so no match crosses one. A match
    on a document's last token has nothing to continue with and does not count."""
    flat = np.concatenate([x for doc in docs for x in (np.array([-1]), np.asarray(doc, np.int64))] + [np.array([-1])])
    q = [int(t) for t in context][-n_max:]
    ends, found = np.flatnonzero((flat == q[-1]) & (np.append(flat[1:], -1) != -1)), []
    for n in range(1, len(q) + 1):
        if n > 1:
            ends = ends[ends - (n - 1) >= 0]
            ends = ends[flat[ends - (n - 1)] == q[-n]]
        if ends.size == 0:
            break
        found.append(ends)
    if len(found) < n_min:
        return [], [], [], 0, 0
    n, ends = len(found), found[-1]
    if max_matches is not None and ends.size > max_matches:
        return None, None, None, n, int(ends.size)
    conts = []
    for e in ends.tolist():
        window = flat[e + 1 : e + 1 + max_depth].tolist()
        conts.append(tuple(window[: window.index(-1)] if -1 in window else window))
    counts = Counter(c[:d] for c in conts for d in range(1, len(c) + 1))
    ranked = sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget]
    nodes = sorted(ranked, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(nodes)}
    tokens = [p[-1] for p in nodes]
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in nodes]
    return tokens, parents, [counts[p] for p in nodes], n, len(conts)


# ---- tiny models and trees --------------------------------------------------------------------

FAMILIES = {
    "llama": lambda **kw: LlamaConfig(**kw),
    "qwen2": lambda **kw: Qwen2Config(use_sliding_window=False, **kw),
    "mistral": lambda **kw: MistralConfig(sliding_window=None, **kw),
}
MODEL_VOCAB = 512


def tiny_causal_lm(family: str, attn: str = "sdpa", seed: int = 0) -> PreTrainedModel:
    """A randomly initialised 2-layer decoder (hidden 64, 4 heads, 2 KV heads, vocab 512), eval mode,
    float32, no eos id (generation runs to max_new_tokens unless a test passes eos ids)."""
    config = FAMILIES[family](
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=MODEL_VOCAB,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def tree_from_paths(paths: Iterable[Sequence[int]], budget: int | None = None) -> DraftTree:
    """The BFS-ordered tree (siblings by ascending token) of all prefixes of ``paths``, cut to the
    first ``budget`` nodes (a BFS prefix is still a tree); counts are 1."""
    closed = {tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)}
    index: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for depth in range(1, max(map(len, closed), default=0) + 1):
        level = sorted((index[p[:-1]] if depth > 1 else -1, p[-1], p) for p in closed if len(p) == depth)
        for parent, token, path in level:
            index[path] = len(tokens)
            tokens.append(token)
            parents.append(parent)
    n = len(tokens) if budget is None else min(budget, len(tokens))
    return DraftTree(np.array(tokens[:n]), np.array(parents[:n]), np.ones(n))


# ---- decoding-loop test doubles: real trees, streamers and stopping criteria ------------------


class ScriptedDrafter:
    """A ``Drafter`` for tests over the tiny models' vocabulary: subclasses say how to draft one
    context (``draft``); batches draft row by row, and ``info`` names the drafter."""

    name = "scripted"

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        raise NotImplementedError

    def draft_batch(self, contexts: Sequence[Sequence[int]], config: DraftConfig) -> list[DraftTree]:
        return [self.draft(context, config) for context in contexts]

    def info(self) -> IndexInfo:
        return IndexInfo(1, self.name, f"sha256:{self.name}", MODEL_VOCAB, 0, 0, ())

    def close(self) -> None:
        pass


class OracleTreeDrafter(ScriptedDrafter):
    """A Drafter that knows the continuations ``references`` (prompt + output, one per prompt it
    will see) and drafts real trees: the right branch cut at a random depth (0 .. max_depth), a
    wrong sibling at every level of it, a wrong token right below the cut, and a wrong child under
    each wrong node."""

    name = "oracle"

    def __init__(self, *references: Sequence[int], seed: int = 0) -> None:
        self.references = [list(reference) for reference in references]
        self.seed = seed
        self.contexts = 0

    def draft(self, context: Sequence[int], config: DraftConfig) -> DraftTree:
        context = list(context)
        matching = [ref for ref in self.references if ref[: len(context)] == context]
        assert matching, "the loop must pass prompt + committed tokens"
        self.contexts += 1
        rng = random.Random(self.seed * 100_003 + len(context))
        future = matching[0][len(context) : len(context) + config.max_depth]
        right = future[: rng.randint(0, len(future))]
        paths = [right]
        for depth in range(min(len(right) + 1, config.max_depth)):
            true_next = future[depth] if depth < len(future) else None
            wrong = (true_next if true_next is not None else rng.randrange(MODEL_VOCAB)) + rng.randrange(1, MODEL_VOCAB)
            paths.append(right[:depth] + [wrong % MODEL_VOCAB, rng.randrange(MODEL_VOCAB)][: config.max_depth - depth])
        return tree_from_paths([p for p in paths if p], budget=config.budget)


class RecordingStreamer(BaseStreamer):
    """Keeps every ``put`` value and whether ``end`` was called."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        assert not self.ended
        self.values.append(value.clone())

    def end(self) -> None:
        self.ended = True


class StopAfterToken(StoppingCriteria):
    """Fires for rows whose last token is ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return input_ids[:, -1] == self.token


def scored_chain(scores: Sequence[float]) -> DraftTree:
    """A chain of tokens 10, 11, ... with these node scores (what a drafter hands a batch rule)."""
    n = len(scores)
    return DraftTree(
        np.arange(10, 10 + n, dtype=np.int32),
        np.arange(-1, n - 1, dtype=np.int32),
        np.ones(n, np.int64),
        2,
        1,
        1,
        np.asarray(scores, np.float64),
    )


def reference_tokens(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int, **kwargs) -> list[int]:
    """New tokens of Hugging Face greedy decoding."""
    output = model.generate(
        torch.tensor([list(prompt)], device=model.device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        **kwargs,
    )
    return output[0, len(prompt) :].tolist()


def chunks(result) -> list[list[int]]:
    """``output_ids`` split into the steps that committed them (the last step may be cut)."""
    out, at = [], 0
    for accepted in result.accepted_per_step:
        out.append(result.output_ids[at : at + accepted + 1])
        at += accepted + 1
    return out


def request_oracle(
    context: list[int], config: DraftConfig, max_candidates: int, extra: Sequence[int] = ()
) -> DraftTree:
    """Brute force of ``RequestMatcher``: the longest suffix (2..n_max tokens) of ``context +
    extra`` occurring inside ``context`` with a successor there (the suffix itself excluded),
    the continuations of its most recent ``max_candidates`` occurrences read up to the end of
    ``context`` (``extra`` is matched, never indexed: ``draft_ahead``), counted by ``top_c_tree``."""
    from rest_spec.datastore.bigram import SEP
    from rest_spec.datastore.trie import top_c_tree

    query, size = [*context, *extra], len(context)
    for n in range(min(config.n_max, len(query)), 1, -1):
        ends = [e for e in range(n - 1, size - 1) if context[e - n + 1 : e + 1] == query[-n:]]
        if ends:
            break
    else:
        return DraftTree.empty()
    if n < config.n_min:
        return DraftTree.empty()
    counted = ends[-max_candidates:]
    rows = np.full((len(counted), config.max_depth), SEP, dtype=np.uint32)
    for row, e in zip(rows, counted):
        continuation = context[e + 1 : e + 1 + config.max_depth]
        row[: len(continuation)] = continuation
    return DraftTree(*top_c_tree(rows, SEP, config.budget), n, len(ends), len(counted))


# ---- processes ---------------------------------------------------------------------------------

# The environment of a command run by a test: one torch thread, as the test process has (conftest.py),
# so that the verify-cost table measured there (smollm2_cost_dir) has the key the command looks up.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# How much longer than on a machine of its own a wall-clock bound may take: CI sets it where it runs
# tests beside other heavy work (the floors' tests beside vLLM's engines, on the same two cores), so
# that a bound checks the behaviour (drafting resumes, a slot frees) and not the load.
TIME_SCALE = float(os.environ.get("REST_TESTS_TIME_SCALE") or 1.0)


def as_from_a_terminal() -> None:
    """A ``preexec_fn`` that starts a child with the stop signals at their defaults, as a terminal
    would: a child inherits ignored signals (a test runner started in the background without job
    control ignores SIGINT, one under nohup SIGHUP), and Python, and the commands, keep ignoring them."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T in ``/proc``; True where there is no
    ``/proc``, or the process is gone)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return all(state in "Tt" for state in states)


class DatastoreProcess:
    """``python -m rest_spec.datastore COMMAND ARGS`` (``serve``, ``route``) with its merged stdout
    and stderr drained into ``lines`` (so its log never blocks it). Start several, then ``wait``
    for each: ``address`` once it printed "listening on", None if it exited first."""

    def __init__(self, command: str, *args) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rest_spec.datastore", command, *map(str, args)],
            cwd=Path(__file__).resolve().parents[1],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.address: str | None = None
        self._done = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("listening on "):
                self.address = line.split()[-1]
                self._done.set()
        self._done.set()  # exited without listening

    def wait(self, seconds: float = 120) -> DatastoreProcess:
        """Until it listens or exits; asserts it did one of them in time."""
        assert self._done.wait(seconds), f"neither listening nor exited after {seconds} s:\n{self.output}"
        return self

    def exit_status(self, seconds: float = 60) -> int:
        return self.proc.wait(timeout=seconds)

    def kill(self) -> None:
        """SIGKILL: no goodbye to its clients."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread of it has stopped: ``kill`` returns before the
        kernel stops a busy process, and on a loaded machine a request sent a few milliseconds
        after the signal can still be answered."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not _stopped(self.proc.pid):
            assert time.monotonic() < deadline, f"pid {self.proc.pid} did not stop within 30 s of SIGSTOP"
            time.sleep(0.001)

    def stop(self) -> int:
        """SIGTERM; its exit status (killed after 30 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def chi_square(counts: Counter, probs: dict) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells (outcomes, with impossible observed ones at
    probability 0) are pooled in ascending order of expected count until each expects >= 5."""
    n = sum(counts.values())
    cells = sorted(set(probs) | set(counts), key=lambda k: probs.get(k, 0.0))
    pooled: list[list[float]] = []  # [observed, expected]
    for key in cells:
        if not pooled or pooled[-1][1] >= 5:
            pooled.append([0.0, 0.0])
        pooled[-1][0] += counts[key]
        pooled[-1][1] += n * probs.get(key, 0.0)
    if len(pooled) > 1 and pooled[-1][1] < 5:
        last = pooled.pop()
        pooled[-1] = [pooled[-1][0] + last[0], pooled[-1][1] + last[1]]
    return sum((o - e) ** 2 / e for o, e in pooled), len(pooled) - 1


def chi_square_critical(df: int, z: float = 4.265) -> float:
    """Upper 1e-5 quantile of chi-square(df) (Wilson-Hilferty; z is the normal 1e-5 quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
