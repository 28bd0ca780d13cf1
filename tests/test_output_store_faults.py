"""Fault injection for the durable output store: a real full disk (a small tmpfs), a real
file-size limit (RLIMIT_FSIZE on a child process), damaged logs, a failed compaction and a
failing fsync. In every case an acknowledged addition survives a restart, a refused one does
not, and no sequence number is given twice."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rest_spec.datastore.outputs import OutputStore, OutputStoreError, OutputStoreWriteError
from tests.tiers import examples

REPO = Path(__file__).resolve().parents[1]
MAGIC_SIZE, HEADER_SIZE = 8, 16
BIG = list(range(5, 2005))  # an 8,016-byte record: more than the slack of a page or a size limit


def log_file(directory: Path) -> Path:
    return directory / "outputs.log"


def small_doc(i: int) -> list[int]:
    return [i % 97, 7, 8, i % 13]


def stored(directory: Path, **options) -> list[list[int]]:
    """The documents a store reopened from ``directory`` holds."""
    with OutputStore(10**7, directory, **options) as store:
        return [d.tolist() for d in store.documents()]


def write_log(directory: Path, docs: list[list[int]]) -> tuple[bytes, list[int]]:
    """Store ``docs`` (seqs 0..) through a real store; the log's bytes and each record's offset."""
    with OutputStore(10**7, directory) as store:
        assert [store.add(doc) for doc in docs] == list(range(len(docs)))
    offsets = list(MAGIC_SIZE + np.cumsum([0] + [HEADER_SIZE + 4 * len(doc) for doc in docs[:-1]]))
    return log_file(directory).read_bytes(), offsets


# ---- a full disk ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs mounted for this test (root only), unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # even if a failed test left a file open


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte with one file and return it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for _ in range(1000):  # 64 MiB at most; the disk is 256 KiB
            os.write(fd, bytes(1 << 16))
        raise AssertionError(f"{disk} never filled up")
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_refuses_additions_and_a_restart_keeps_exactly_the_acknowledged_ones(small_disk, caplog):
    directory = small_disk / "store"
    acked: dict[int, list[int]] = {}
    with OutputStore(10**7, directory) as store:
        for i in range(3):
            acked[store.add(small_doc(i))] = small_doc(i)
        committed = log_file(directory).stat().st_size
        filler = fill(small_disk)
        for _ in range(2):  # the first write lands partly (the log's last page has room), then fails
            with pytest.raises(OutputStoreWriteError) as refused:
                store.add(BIG)
            assert refused.value.errno == errno.ENOSPC
            assert str(refused.value) == (
                f"output store {directory}: writing the log failed "
                "(No space left on device); the addition was NOT stored"
            )
            assert log_file(directory).stat().st_size == committed  # cut back: no garbage stays
            assert [d.tolist() for d in store.documents()] == list(acked.values())  # nor in memory
        filler.unlink()
        for i in range(3, 6):
            acked[store.add(small_doc(i))] = small_doc(i)
        acked[store.add(BIG)] = BIG
    assert list(acked) == list(range(7))  # a refused addition takes no number
    caplog.clear()
    with caplog.at_level(logging.WARNING), OutputStore(10**7, directory) as store:
        assert [d.tolist() for d in store.documents()] == list(acked.values())
        assert store.add([1, 2]) == 7
    assert not caplog.records  # nothing torn, nothing dropped


# ---- a file-size limit, without privileges ----------------------------------------------------

WRITER = """
import json, signal, sys
from rest_spec.datastore.outputs import OutputStore, OutputStoreWriteError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails with EFBIG instead
with OutputStore(10**7, sys.argv[1]) as store:
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            print(json.dumps(["ack", store.add(json.loads(line))]), flush=True)
        except OutputStoreWriteError as exc:
            print(json.dumps(["refused", exc.errno, str(exc)]), flush=True)
"""


def test_a_file_size_limit_refuses_additions_and_a_restart_keeps_exactly_the_acknowledged_ones(tmp_path):
    """A child process owns the store; its RLIMIT_FSIZE is lowered from here to just past the
    log's end (so the next record lands partly, then fails with EFBIG) and raised again."""
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        cwd=REPO,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None

    def add(tokens: list[int]) -> list:
        child.stdin.write(json.dumps(tokens) + "\n")
        child.stdin.flush()
        answer = child.stdout.readline()
        assert answer, "the writer died"
        return json.loads(answer)

    try:
        assert child.stdout.readline() == "ready\n"
        acked = {add(small_doc(i))[1]: small_doc(i) for i in range(3)}
        committed = log_file(tmp_path).stat().st_size
        limits = resource.prlimit(child.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(child.pid, resource.RLIMIT_FSIZE, (committed + 100, limits[1]))
        for _ in range(2):
            outcome, code, message = add(BIG)
            assert (outcome, code) == ("refused", errno.EFBIG)
            assert str(tmp_path) in message and "the addition was NOT stored" in message
            assert log_file(tmp_path).stat().st_size == committed
        resource.prlimit(child.pid, resource.RLIMIT_FSIZE, limits)
        for tokens in (small_doc(3), BIG, small_doc(4)):
            outcome, seq = add(tokens)
            acked[seq] = tokens
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert child.returncode == 0
    assert list(acked) == list(range(6))
    with OutputStore(10**7, tmp_path) as store:
        assert [d.tolist() for d in store.documents()] == list(acked.values())
        assert store.add([1, 2]) == 6


# ---- a failing fsync (EIO) --------------------------------------------------------------------


def test_a_failed_cut_back_refuses_every_addition_until_it_succeeds(tmp_path, monkeypatch):
    """EIO from fsync cannot be caused for real here, so os.fsync is wrapped: it fails while
    ``failing`` is set. The record reaches the page cache, fsync fails, the cut-back's fsync
    fails too: every addition is refused until a cut-back succeeds, then the numbering goes on
    and the file holds exactly the acknowledged records."""
    fsync, failing = os.fsync, [False]

    def flaky_fsync(fd: int) -> None:
        if failing[0]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        fsync(fd)

    with OutputStore(10**7, tmp_path) as store:
        assert store.add(small_doc(0)) == 0
        committed = log_file(tmp_path).stat().st_size
        monkeypatch.setattr(os, "fsync", flaky_fsync)
        failing[0] = True
        with pytest.raises(OutputStoreWriteError, match="writing the log failed .Input/output error.") as first:
            store.add(small_doc(1))
        assert first.value.errno == errno.EIO
        with pytest.raises(OutputStoreWriteError, match="cannot be cut back to its last acknowledged record"):
            store.add(small_doc(2))
        assert len(store) == 1
        failing[0] = False
        assert store.add(small_doc(3)) == 1
    monkeypatch.undo()
    assert log_file(tmp_path).stat().st_size == committed + HEADER_SIZE + 4 * 4
    assert stored(tmp_path) == [small_doc(0), small_doc(3)]


# ---- damaged logs -----------------------------------------------------------------------------

DOCS = [[i, i + 1, i + 2, i % 5, 9][: 2 + i % 4] for i in range(6)]

DAMAGE = {  # name -> (field offset within the record, bytes written there)
    "token": (HEADER_SIZE, b"\xff"),
    "sequence number": (0, b"\x07"),
    "length field": (8, b"\x40"),
    "length field, tiny": (8, b"\x00\x00\x00\x00"),
    "checksum": (12, b"\x00"),
    "zeroed span into the next record": (0, bytes(40)),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_before_valid_records_is_refused_naming_the_offset_and_salvage_keeps_them(tmp_path, damage, caplog):
    data, offsets = write_log(tmp_path, DOCS)
    at, patch = DAMAGE[damage]
    damaged = bytearray(data)
    damaged[offsets[2] + at : offsets[2] + at + len(patch)] = patch
    log_file(tmp_path).write_bytes(bytes(damaged))
    lost = 2 if at + len(patch) > len(DOCS[2]) * 4 + HEADER_SIZE else 1
    kept, following = DOCS[:2] + DOCS[2 + lost :], len(DOCS) - 2 - lost
    with pytest.raises(OutputStoreError) as refused:
        OutputStore(10**7, tmp_path)
    assert str(refused.value).startswith(
        f"{log_file(tmp_path)}: corrupt record at byte {offsets[2]}, followed by {following} valid records"
    )
    assert log_file(tmp_path).read_bytes() == bytes(damaged)  # refusing changes nothing
    with caplog.at_level(logging.WARNING), OutputStore(10**7, tmp_path, salvage=True) as store:
        assert [d.tolist() for d in store.documents()] == kept
        assert store.add([1, 2]) == len(DOCS)
    assert f"salvaged {len(kept)} valid records" in caplog.text
    assert stored(tmp_path) == kept + [[1, 2]]  # the rewritten log opens without salvage


@pytest.mark.parametrize("inserted", [b"\x01\x02\x03", bytes(3 << 19)], ids=["3 bytes", "1.5 MiB"])
def test_bytes_inserted_between_records_are_found_and_salvaged(tmp_path, inserted):
    """Records shifted off their place are still found, however far (the search goes by chunks)."""
    data, offsets = write_log(tmp_path, DOCS)
    log_file(tmp_path).write_bytes(data[: offsets[3]] + inserted + data[offsets[3] :])
    with pytest.raises(OutputStoreError, match=f"corrupt record at byte {offsets[3]}, followed by 3 valid"):
        OutputStore(10**7, tmp_path)
    assert stored(tmp_path, salvage=True) == DOCS


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=3))
def test_any_damaged_bytes_are_refused_or_torn_and_salvage_keeps_every_other_record(tmp_path_factory, flips):
    """Bytes flipped anywhere after the magic: damage with no valid record after it is a torn
    tail, any other is refused; salvage loses exactly the damaged records."""
    directory = tmp_path_factory.mktemp("log")
    data, offsets = write_log(directory, DOCS)
    damaged = bytearray(data)
    for where, xor in flips:
        damaged[MAGIC_SIZE + int(where * (len(data) - MAGIC_SIZE))] ^= xor
    changed = np.flatnonzero(np.frombuffer(damaged, np.uint8) != np.frombuffer(data, np.uint8))
    hit = set((np.searchsorted(offsets, changed, side="right") - 1).tolist())  # two flips may cancel
    log_file(directory).write_bytes(bytes(damaged))
    kept = [doc for i, doc in enumerate(DOCS) if i not in hit]
    first = min(hit, default=len(DOCS))
    after = sum(1 for i in range(first + 1, len(DOCS)) if i not in hit)
    if after == 0:  # nothing valid follows the damage: a torn tail, as after a crash mid-write
        assert stored(directory) == kept
    else:
        refusal = f"corrupt record at byte {offsets[first]}, followed by {after} valid"
        with pytest.raises(OutputStoreError, match=refusal):
            OutputStore(10**7, directory)
        assert stored(directory, salvage=True) == kept


def test_a_torn_last_record_is_dropped_with_a_warning_and_its_number_reused(tmp_path, caplog):
    """A crash mid-write: the file ends inside the last record (its header whole). That record
    was never acknowledged, so its number is free."""
    data, offsets = write_log(tmp_path, DOCS + [[3, 4, 5]])
    log_file(tmp_path).write_bytes(data[:-3])
    with caplog.at_level(logging.WARNING), OutputStore(10**7, tmp_path) as store:
        assert [d.tolist() for d in store.documents()] == DOCS
        assert store.add([3, 3]) == len(DOCS)
    assert f"dropping a torn last record ({len(data) - 3 - offsets[-1]} bytes at byte {offsets[-1]})" in caplog.text
    assert log_file(tmp_path).stat().st_size == offsets[-1] + HEADER_SIZE + 8


def test_a_log_that_is_not_a_regular_file_is_refused_without_hanging(tmp_path):
    os.mkfifo(log_file(tmp_path))
    with pytest.raises(OutputStoreError, match="outputs.log is not a regular file"):
        OutputStore(10**7, tmp_path)


def test_a_log_with_token_ids_outside_the_vocabulary_is_refused(tmp_path):
    write_log(tmp_path, [[1, 2], [3, 70_000]])
    with pytest.raises(OutputStoreError, match="sequence number 1 holds token id 70000, outside the vocabulary"):
        OutputStore(10**7, tmp_path, vocab_size=50_000)


# ---- compaction -------------------------------------------------------------------------------


def stored_records(directory: Path) -> int:
    """Records of ``small_doc`` size in the log."""
    return (log_file(directory).stat().st_size - MAGIC_SIZE) // (HEADER_SIZE + 4 * 4)


def test_a_failed_compaction_keeps_the_old_log_and_the_acknowledged_addition(tmp_path, caplog):
    """The compaction's temporary file cannot be created (a directory is in its place): the
    addition that triggered it is durable, so it is acknowledged, and the old log stays. A
    store of two documents compacts when the evicted outweigh the live: at the 5th and 8th."""
    with OutputStore(8, tmp_path) as store:
        for i in range(4):
            store.add(small_doc(i))
        blocker = tmp_path / "outputs.tmp"
        blocker.mkdir()
        with caplog.at_level(logging.WARNING):
            assert store.add(small_doc(4)) == 4
        assert "rewriting the log failed (Is a directory); the old log is unchanged" in caplog.text
        assert [d.tolist() for d in store.documents()] == [small_doc(3), small_doc(4)]
        assert stored_records(tmp_path) == 5
        crashed_here = tmp_path.parent / f"{tmp_path.name}-copy"  # a crash now leaves the old log
        crashed_here.mkdir()
        shutil.copy(log_file(tmp_path), log_file(crashed_here))
        with OutputStore(8, crashed_here) as replayed:
            assert [d.tolist() for d in replayed.documents()] == [small_doc(3), small_doc(4)]
        blocker.rmdir()
        for i in range(5, 8):
            assert store.add(small_doc(i)) == i
        assert stored_records(tmp_path) == 2  # compacted, now that it can be
    with OutputStore(8, tmp_path) as store:
        assert [d.tolist() for d in store.documents()] == [small_doc(6), small_doc(7)]


def test_no_sequence_number_is_given_twice_when_a_smaller_store_evicts_every_document(tmp_path):
    write_log(tmp_path, [BIG[:40]] * 3)
    with OutputStore(30, tmp_path) as store:  # every 40-token document is evicted at open
        assert len(store) == 0
    with OutputStore(30, tmp_path) as store:
        assert store.add([1, 2]) == 3
