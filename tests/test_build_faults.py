"""Fault injection for builds: a build never removes what it did not create, never hangs on a
special file, and a full disk or a stop signal leaves the previous index as it was.

Real faults through the real CLI (a subprocess): FIFOs, sockets and device links in a corpus, a
small tmpfs and a lowered RLIMIT_FSIZE under --out, SIGINT/SIGTERM/SIGHUP while the tokenizer
workers run, and leftovers of killed builds beside the target.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rest_spec.build_index.writer import IndexWriter
from rest_spec.datastore import format as fmt
from tests.helpers import STOP_SIGNALS, as_from_a_terminal
from tests.test_build_cli import (  # noqa: F401 (tiny, tiny_tokenizer: fixtures)
    CLI_ENV,
    assert_holds,
    built,
    cli_command,
    index_tokens,
    leftovers,
    run_cli,
    tiny,
    tiny_tokenizer,
)


def snapshot(root: Path) -> dict[str, object]:
    """Everything under ``root`` (itself included): file bytes, link targets, other kinds by name."""
    paths = [root, *root.rglob("*")] if root.is_dir() and not root.is_symlink() else [root]
    state = {}
    for path in paths:
        key = str(path.relative_to(root.parent))
        if path.is_symlink():
            state[key] = ("link", os.readlink(path))
        elif path.is_file():
            state[key] = path.read_bytes()
        else:
            state[key] = "dir" if path.is_dir() else "special"
    return state


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture(scope="module")
def previous_index(tmp_path_factory, tiny_tokenizer) -> Path:
    """A real index that the tests below try to replace; each copies it."""
    root = tmp_path_factory.mktemp("previous")
    (root / "previous.txt").write_text("the previous corpus, which must survive")
    built(
        "--corpus",
        root / "previous.txt",
        "--tokenizer",
        tiny_tokenizer,
        "--out",
        root / "idx",
        "--workers",
        1,
        cwd=root,
    )
    return root / "idx"


@pytest.fixture(scope="module")
def big_text(tmp_path_factory) -> Path:
    """About 570 KB of code: an index of it needs more than 1 MiB in its suffix array alone (1.8 MB
    with the tiny tokenizer, its tokens 0.9 MB)."""
    path = tmp_path_factory.mktemp("big") / "big.py"
    path.write_text("".join(f"def function_{i}(x, y):\n    return x * {i} + y // {i + 1}\n" for i in range(10_000)))
    return path


# --------------------------------------------------------------------------- --overwrite


def _plain_directory(out: Path, index: Path) -> None:
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    (out / "sub" / "deep.txt").write_text("keep me too")


def _regular_file(out: Path, index: Path) -> None:
    out.write_text("keep me")


def _link_to_an_index(out: Path, index: Path) -> None:
    shutil.copytree(index, out.parent / "real")
    out.symlink_to(out.parent / "real")


def _index_with_a_foreign_file(out: Path, index: Path) -> None:
    shutil.copytree(index, out)
    (out / "notes.txt").write_text("keep me")


def _another_format(out: Path, index: Path) -> None:
    out.mkdir()
    (out / fmt.MANIFEST).write_text('{"format": "something-else"}')
    (out / "shard-00000.tokens.npy").write_bytes(b"not ours")


def _manifest_is_a_fifo(out: Path, index: Path) -> None:
    out.mkdir()
    os.mkfifo(out / fmt.MANIFEST)  # opening it would block: the check must not


@pytest.mark.build
@pytest.mark.parametrize(
    "make, reason",
    [
        (_plain_directory, "it has no manifest.json, so it is not an index"),
        (_regular_file, "it is not a directory"),
        (_link_to_an_index, "it is a symbolic link, not an index directory"),
        (_index_with_a_foreign_file, "it holds 'notes.txt', which build_index does not write"),
        (_another_format, "its manifest.json does not declare format 'rest-index'"),
        (_manifest_is_a_fifo, "its manifest.json is not a regular file"),
    ],
    ids=["directory", "file", "symlink", "index-with-foreign-file", "other-format", "fifo-manifest"],
)
def test_overwrite_refuses_what_is_not_an_index(tmp_path, tiny_tokenizer, previous_index, make, reason):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a new corpus")
    out = tmp_path / "targets" / "out"
    out.parent.mkdir()
    make(out, previous_index)
    before = snapshot(out.parent)

    result = run_cli(
        "--corpus", corpus, "--tokenizer", tiny_tokenizer, "--out", out, "--overwrite", cwd=tmp_path, timeout=120
    )

    assert result.returncode == 1
    assert one_line(result.stderr).startswith(f"build_index: error: refusing to replace {out}: {reason}")
    assert snapshot(out.parent) == before and leftovers(out.parent) == []


def test_an_out_path_under_a_regular_file_is_a_one_line_error(tmp_path, tiny_tokenizer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a corpus")
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "idx"

    result = run_cli("--corpus", corpus, "--tokenizer", tiny_tokenizer, "--out", out, cwd=tmp_path, timeout=120)

    assert result.returncode == 1
    assert one_line(result.stderr) == f"build_index: error: cannot use {out} as the index directory: Not a directory"
    assert (tmp_path / "file").read_text() == "not a directory"


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("chats.jsonl", b'{"text": "a b c"}\n{"text": "cut off\n', "json parse error"),
        ("chats.parquet", b"PAR1 not really parquet", "parquet"),
    ],
    ids=["jsonl", "parquet"],
)
def test_a_data_file_datasets_cannot_parse_is_one_line(tmp_path, tiny_tokenizer, name, data, message):
    """``datasets`` logs an ERROR for a file it cannot parse before it raises: the build says it
    once, in its own line, not three times (datasets' handler and the root's printed it too)."""
    corpus = tmp_path / name
    corpus.write_bytes(data)
    result = run_cli(
        "--corpus", corpus, "--tokenizer", tiny_tokenizer, "--out", tmp_path / "out", cwd=tmp_path, timeout=120
    )
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert line.startswith(f"build_index: error: cannot read {corpus}: ") and message in line.lower(), line
    assert not (tmp_path / "out").exists()


@pytest.mark.build
def test_overwrite_replaces_an_index_beside_leftovers_of_killed_builds(tmp_path, tiny_tokenizer, previous_index):
    """Killed builds leave ``.NAME.tmp-PID``/``.NAME.old-PID`` beside the target; the next build
    says so, removes neither, and is not in their way even when it gets the same PID."""
    out = shutil.copytree(previous_index, tmp_path / "idx")
    corpus = tmp_path / "new.txt"
    corpus.write_text("the new corpus replaces the previous one")
    exited = subprocess.Popen(["true"])
    exited.wait()
    killed_tmp = tmp_path / f".idx.tmp-{exited.pid}"
    killed_tmp.mkdir()
    (killed_tmp / "shard-00000.tokens.npy").write_bytes(b"partial")

    def leftover_with_this_pid() -> None:
        """Runs in the child before exec, so its PID is the build's: a killed build's PID come round again."""
        old = tmp_path / f".idx.old-{os.getpid()}"
        old.mkdir()
        (old / fmt.MANIFEST).write_text("{}")

    result = run_cli("--corpus", corpus, "--tokenizer", tiny_tokenizer, "--out", out, "--overwrite", "--workers", 1,
                     cwd=tmp_path, quiet=False, preexec_fn=leftover_with_this_pid)  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert fmt.read_manifest(out).corpus["path"] == str(corpus)
    assert f"{killed_tmp} is the partial output of a build that was killed; remove it" in result.stderr
    assert (killed_tmp / "shard-00000.tokens.npy").read_bytes() == b"partial"
    (same_pid,) = tmp_path.glob(".idx.old-*")  # the build's own old index was removed after the publish
    assert (same_pid / fmt.MANIFEST).read_text() == "{}"


def test_publish_checks_the_target_again(tmp_path, previous_index):
    """A file dropped into the old index while the build ran: the target is refused at publish too."""
    out = shutil.copytree(previous_index, tmp_path / "idx")
    with pytest.raises(FileExistsError, match="it holds 'added.txt'"):
        with IndexWriter(out, tokenizer_name="t", tokenizer_fingerprint="f", vocab_size=10, overwrite=True) as writer:
            writer.add_document([1, 2, 3])
            (out / "added.txt").write_text("written during the build")
            writer.finish()
    assert (out / "added.txt").exists() and fmt.read_manifest(out).num_documents == 1
    assert leftovers(tmp_path) == []


def test_a_signal_between_the_publishing_renames_waits_for_both(tmp_path, previous_index, monkeypatch):
    """SIGTERM right after the old index is moved aside: the new one still goes into place, and
    the signal's handler runs after that, so the target is never missing."""

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped(signum)

    out = shutil.copytree(previous_index, tmp_path / "idx")
    rename = os.replace
    renames = []

    def rename_then_signal(src, dst):
        rename(src, dst)
        renames.append(Path(dst).name)
        if len(renames) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, between the two renames

    previous_handler = signal.signal(signal.SIGTERM, stop)
    monkeypatch.setattr(os, "replace", rename_then_signal)
    try:
        with pytest.raises(Stopped):
            with IndexWriter(
                out, tokenizer_name="t", tokenizer_fingerprint="f", vocab_size=10, overwrite=True
            ) as writer:
                writer.add_document([4, 5, 6, 7])
                writer.finish()
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    assert len(renames) == 2
    assert fmt.read_manifest(out).num_tokens == 4 and leftovers(tmp_path) == []


# --------------------------------------------------------------------------- special files


@pytest.mark.build
def test_special_files_in_a_corpus_directory_are_skipped(tmp_path, tiny_tokenizer, tiny):
    """A FIFO (listed first: opening it would hang), a socket, links to /dev/zero and /dev/null, a
    dangling link and a file over the default --max-file-mib (32, sparse here): each skipped with a
    warning, none opened."""
    root = tmp_path / "corpus"
    root.mkdir()
    os.mkfifo(root / "0-fifo.txt")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(root / "1-socket.txt"))
    (root / "2-zero.txt").symlink_to("/dev/zero")
    (root / "3-null.txt").symlink_to("/dev/null")
    (root / "4-dangling.txt").symlink_to(root / "nowhere")
    with open(root / "5-big.txt", "wb") as big:
        big.truncate((32 << 20) + 1)
    (root / "a.txt").write_text("the only document")
    try:
        result = run_cli("--corpus", root, "--tokenizer", tiny_tokenizer, "--out", tmp_path / "idx", "--workers", 1,
                         "--json", cwd=tmp_path, quiet=False, timeout=120)  # fmt: skip
    finally:
        server.close()

    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "skipped: " in line]
    expected = [
        f"file {root}/0-fifo.txt is a named pipe (FIFO), not a regular file",
        f"file {root}/1-socket.txt is a socket, not a regular file",
        f"file {root}/2-zero.txt is a character device, not a regular file",
        f"file {root}/3-null.txt is a character device, not a regular file",
        f"cannot read {root}/4-dangling.txt: No such file or directory",
        f"file {root}/5-big.txt is over 32 MiB (raise the limit with --max-file-mib)",
    ]
    assert [line.split("skipped: ", 1)[1] for line in warnings] == expected
    assert json.loads(result.stdout)["skipped"] == 6
    assert_holds(tmp_path / "idx", ["the only document"], tiny)


@pytest.mark.build
@pytest.mark.parametrize(
    "args, message",
    [
        (["--corpus", "fifo"], "corpus fifo is a named pipe (FIFO), not a regular file"),
        (["--corpus", "socket"], "corpus socket is a socket, not a regular file"),
        (["--corpus", "null.txt"], "corpus null.txt is a character device, not a regular file"),
        (
            ["--corpus", "sharegpt", "--data-files", "fifo.json"],
            "data file fifo.json is a named pipe (FIFO), not a regular file",
        ),
    ],
    ids=["fifo", "socket", "dev-null", "data-file-fifo"],
)
def test_a_special_file_named_as_the_corpus_is_an_error(tmp_path, tiny_tokenizer, args, message):
    os.mkfifo(tmp_path / "fifo")
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "null.txt").symlink_to("/dev/null")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "socket"))
    try:
        result = run_cli(*args, "--tokenizer", tiny_tokenizer, "--out", tmp_path / "idx", cwd=tmp_path, timeout=60)
    finally:
        server.close()
    assert result.returncode == 1
    assert one_line(result.stderr) == f"build_index: error: {message}"
    assert not (tmp_path / "idx").exists() and leftovers(tmp_path) == []


# --------------------------------------------------------------------------- stop signals


def _workers(pid: int) -> list[int]:
    """The tokenizer worker processes among ``pid``'s children."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    except OSError:  # the process or a child has exited
        return []


def _gone(pid: int) -> bool:
    """No such process, or only its exit status is left (a zombie, for init to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.build
@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_stops_the_workers_and_leaves_the_previous_index(
    tmp_path, tiny_tokenizer, previous_index, signum
):
    """Signalled while two tokenizer workers encode the packaged ShareGPT file (it takes a while)."""
    out = shutil.copytree(previous_index, tmp_path / "idx")
    before = snapshot(out)
    args = ["--corpus", "sharegpt", "--tokenizer", tiny_tokenizer, "--out", out, "--overwrite", "--workers", 2]
    proc = subprocess.Popen(cli_command(*args), cwd=tmp_path, env=CLI_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal)  # fmt: skip
    workers = []
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and not (leftovers(tmp_path) and len(workers) >= 2):
            time.sleep(0.05)
            workers = _workers(proc.pid)
        time.sleep(0.5)  # tokenization under way
        assert proc.poll() is None and len(workers) == 2, "the build ended before it could be signalled"
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
        deadline = time.monotonic() + 30
        while not all(map(_gone, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)

        assert proc.returncode == 128 + signum, stderr
        name = signal.Signals(signum).name
        assert one_line(stderr) == f"build_index: interrupted ({name}); no index was written; {out} is unchanged"
        assert all(map(_gone, workers)), "tokenizer workers left running"
        assert leftovers(tmp_path) == [] and snapshot(out) == before
        index_tokens(out)  # the previous index still opens, every file checked in full
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in workers:  # the old code left them behind
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


STOPPED_POOL = """
import os, signal, sys, time
from tokenizers import Tokenizer
from rest_spec.build_index.tokenize import BatchTokenizer, TokenizeConfig, _encode_in_worker

tokenizer = Tokenizer.from_file(sys.argv[1])
try:
    with BatchTokenizer(tokenizer, TokenizeConfig(workers=2)) as encoder:
        pool = encoder._pool
        workers = [process.pid for process in pool._processes.values()]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)  # no worker reads the call queue now
        for _ in range(4):  # each batch larger than a pipe's buffer: the feeder thread blocks writing one
            pool.submit(_encode_in_worker, ["x" * 100_000])
        time.sleep(0.5)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)  # and none ever will (killed, as by the OOM killer or a stop)
        raise RuntimeError("stop")
except RuntimeError:
    print("shut down")
"""


def test_an_error_while_a_batch_is_half_written_to_stopped_workers_does_not_hang(tiny_tokenizer):
    """The tokenizer pool's shutdown after an error or a stop signal returns although its call
    queue's feeder thread is blocked writing a batch larger than a pipe's buffer to workers that
    died before reading it (``build_index.tokenize._terminate``; on Python 3.11 the shutdown waited
    for that thread for ever: a CI run caught a build stopped by a signal hanging there)."""
    done = subprocess.run(
        [sys.executable, "-c", STOPPED_POOL, str(tiny_tokenizer / "tokenizer.json")],
        capture_output=True, text=True, timeout=60, env=CLI_ENV,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "shut down\n", done.stderr[-2000:]


# --------------------------------------------------------------------------- a full disk


def _assert_write_failed(result: subprocess.CompletedProcess, out: Path, before: dict, error: int) -> None:
    assert result.returncode == 1, result.stderr
    assert one_line(result.stderr) == (
        f"build_index: error: cannot write index to {out}: [Errno {error}] {os.strerror(error)}; "
        f"the partial build was removed, {out} is unchanged"
    )
    assert snapshot(out) == before and leftovers(out.parent) == []
    index_tokens(out)


@pytest.mark.build
def test_a_file_size_limit_while_writing_ends_in_one_line(tmp_path, tiny_tokenizer, previous_index, big_text):
    """RLIMIT_FSIZE lowered in the child (SIGXFSZ ignored, so writes fail with EFBIG): runs anywhere."""
    out = shutil.copytree(previous_index, tmp_path / "idx")
    before = snapshot(out)

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    result = run_cli("--corpus", big_text, "--tokenizer", tiny_tokenizer, "--out", out, "--overwrite", "--workers", 1,
                     cwd=tmp_path, timeout=120, preexec_fn=limit_file_size)  # fmt: skip
    _assert_write_failed(result, out, before, errno.EFBIG)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs; skipped where mounting is not permitted."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.build
def test_a_full_disk_while_writing_ends_in_one_line(tmp_path, tiny_tokenizer, previous_index, big_text, small_tmpfs):
    out = shutil.copytree(previous_index, small_tmpfs / "idx")
    before = snapshot(out)
    result = run_cli("--corpus", big_text, "--tokenizer", tiny_tokenizer, "--out", out, "--overwrite", "--workers", 1,
                     cwd=tmp_path, timeout=120)  # fmt: skip
    _assert_write_failed(result, out, before, errno.ENOSPC)
    assert shutil.disk_usage(small_tmpfs).used < 1 << 16  # the partial build's space is free again
