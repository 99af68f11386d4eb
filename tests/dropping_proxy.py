"""A TCP proxy on loopback that closes the connection on the first `drops` generation requests it sees.

The gateway then gets "server disconnected without sending a response", as from an engine that closed a pooled
keep-alive connection (llama.cpp does after streams) or died mid-request. Everything else is piped through.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

GENERATION_REQUEST = b"POST /v1/"


class DroppingProxy:
    def __init__(self, target_url: str, drops: int) -> None:
        self.target = ("127.0.0.1", int(target_url.rsplit(":", 1)[1]))
        self.drops_left = drops
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # so that serve() sees `_stopped` soon
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by stop()
                return
            client.settimeout(None)
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                sock.close()

    def _pipe(self, source: socket.socket, sink: socket.socket, inspect: bool) -> None:
        with suppress(OSError):
            while chunk := source.recv(65536):
                if inspect and chunk.startswith(GENERATION_REQUEST) and self._take_drop():
                    break  # before the request reaches the engine
                sink.sendall(chunk)
        for sock in (source, sink):  # wakes the other direction's recv
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _take_drop(self) -> bool:
        with self._lock:
            if self.drops_left <= 0:
                return False
            self.drops_left -= 1
            return True


@contextmanager
def dropping_proxy(target_url: str, drops: int) -> Iterator[DroppingProxy]:
    """A proxy to `target_url` (http://127.0.0.1:PORT), serving from a background thread until the block ends."""
    proxy = DroppingProxy(target_url, drops)
    thread = threading.Thread(target=proxy.serve, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.stop()
        thread.join(10)
