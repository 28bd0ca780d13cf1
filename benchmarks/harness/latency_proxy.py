"""A TCP proxy on loopback that adds a fixed round-trip time: a stand-in for a datastore across a
real network (1-5 ms round trips) when client and server share this machine.

    with LatencyProxy("127.0.0.1:50051", rtt=0.002) as proxy:
        RemoteDrafter(proxy.address)  # every byte each way arrives rtt / 2 later

Each direction of each connection has a reader that timestamps what it reads and a writer that
sends it once its delay has passed, in order, so added latency does not cap bandwidth (a reply
in several TCP segments is delayed once, not once per segment).
"""

from __future__ import annotations

import queue
import socket
import threading
import time


class LatencyProxy:
    """Forwards connections made to ``address`` (an ephemeral loopback port) to ``target``
    (HOST:PORT), delaying every byte by ``rtt / 2`` in each direction. ``rtt`` may be changed
    while running. ``stop()`` (or leaving the ``with`` block) closes every connection."""

    def __init__(self, target: str, rtt: float = 0.0) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host.strip("[]"), int(port))
        self.rtt = rtt
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True, name="latency-proxy").start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()  # the target is down: the client sees the connection drop
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                pending: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(source, pending), daemon=True).start()
                threading.Thread(target=self._write, args=(sink, pending), daemon=True).start()

    def _read(self, source: socket.socket, pending: queue.Queue) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            pending.put((time.perf_counter() + self.rtt / 2, data))
            if not data:
                return

    def _write(self, sink: socket.socket, pending: queue.Queue) -> None:
        while True:
            due, data = pending.get()
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            try:
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(data)
            except OSError:
                return

    def stop(self) -> None:
        self._stopped = True
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.close()
                except OSError:
                    pass

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.harness.latency_proxy --target HOST:PORT --rtt-ms 2``: prints ``listening on
    ADDRESS`` and forwards until killed (a proxy in its own process, off the client's GIL)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, metavar="HOST:PORT")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="added round trip (default: %(default)s)")
    args = parser.parse_args(argv)
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # before the threads start: they inherit it
    proxy = LatencyProxy(args.target, args.rtt_ms / 1e3)
    print(f"listening on {proxy.address}", flush=True)
    signal.sigwait(stop)
    proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
