"""A small HTTP/1.1 proxy in front of the S3 server that answers some requests with 503 SlowDown and
drops some connections without an answer, to test the client's retries (127.0.0.1 only)."""

from __future__ import annotations

import socket
import threading

SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: 95\r\n\r\n"
            b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>\n    ")


def _read_head(sock: socket.socket, buf: bytearray) -> bytes | None:
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    del buf[:end]
    return head


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def _read_body(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        data = sock.recv(max(65536, n - len(buf)))
        if not data:
            raise ConnectionError("closed mid-body")
        buf += data
    body = bytes(buf[:n])
    del buf[:n]
    return body


class FaultProxy:
    """Forwards to 127.0.0.1:`upstream`; every `slowdown_every`-th request gets a 503, every
    `drop_every`-th has its connection closed without an answer (0: never)."""

    def __init__(self, upstream: int, slowdown_every: int = 3, drop_every: int = 7) -> None:
        self.upstream = upstream
        self.slowdown_every, self.drop_every = slowdown_every, drop_every
        self.requests = self.slowdowns = self.drops = 0
        self._lock = threading.Lock()
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        self._closed = False
        # Every connection and thread, so that close() leaves none running: a thread left behind makes
        # the loader's later tests in this process spawn where they expect a fork.
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    client.close()
                    return
                self._conns.add(client)
                thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
                self._threads.append(thread)
            thread.start()

    def _fault(self) -> str:
        with self._lock:
            self.requests += 1
            n = self.requests
            if self.drop_every and n % self.drop_every == 0:
                self.drops += 1
                return "drop"
            if self.slowdown_every and n % self.slowdown_every == 0:
                self.slowdowns += 1
                return "slowdown"
        return ""

    def _serve(self, client: socket.socket) -> None:
        up: socket.socket | None = None
        buf, upbuf = bytearray(), bytearray()
        try:
            while True:
                head = _read_head(client, buf)
                if head is None:
                    return
                body = _read_body(client, buf, _length(head))
                fault = self._fault()
                if fault == "drop":
                    return
                if fault == "slowdown":
                    client.sendall(SLOWDOWN)
                    continue
                if up is None:
                    up = socket.create_connection(("127.0.0.1", self.upstream))
                    with self._lock:
                        self._conns.add(up)
                up.sendall(head + body)
                rhead = _read_head(up, upbuf)
                if rhead is None:
                    return
                no_body = head.startswith(b"HEAD ") or rhead.split(b" ", 2)[1] in (b"204", b"304")
                rbody = b"" if no_body else _read_body(up, upbuf, _length(rhead))
                client.sendall(rhead + rbody)
        except (OSError, ConnectionError):
            return
        finally:
            client.close()
            if up is not None:
                up.close()

    def close(self) -> None:
        """Stop accepting, end every connection, and wait for every thread (bounded)."""
        with self._lock:
            self._closed = True
            conns, threads = list(self._conns), list(self._threads)
        for sock in [self._server, *conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() or recv()
            except OSError:
                pass
        self._server.close()
        for thread in [self._thread, *threads]:
            thread.join(timeout=10)
