"""The signals that stop a long job (a build, a fill of outputs), and a way to hold them off for a short critical section."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while the block runs and deliver them after it, to whatever
    handles them then (a handler, or the default action).

    For steps that must not stop halfway: renaming an index into place, starting worker processes.
    Python runs signal handlers in the main thread between bytecodes, and the kernel may hand a
    signal to any thread, so masking it in this thread (``pthread_sigmask``) would not keep the
    handler out; recording it in a handler of our own does. Only the main thread can set handlers;
    in another thread no Python handler can interrupt the block anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {}
    try:
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, lambda signum, frame: received.append(signum))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signal.raise_signal(received[0])
