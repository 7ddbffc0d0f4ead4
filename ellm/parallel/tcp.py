"""The collective's transport across machines: a full mesh of TCP connections, every rank sending its bytes to
every other rank each call (ranks are few: one per machine or socket).

Rank r listens on its own address and connects to every rank below it; each connection starts with the
connecting rank's number. A call sends an 8-byte length then the payload to every peer and receives theirs,
interleaving sends and receives without blocking (two ranks sending each other megabytes at once would
otherwise both wait for a reader). A peer that closes its connection, or stays silent past the timeout,
fails the call: no rank waits forever.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import time

import numpy as np

from .ccl import Communicator, Traffic

_LEN = struct.Struct("<q")


def parse_addresses(spec: str) -> list[tuple[str, int]]:
    """"host:port,host:port,...": one address per rank, in rank order."""
    out = []
    for part in spec.split(","):
        host, _, port = part.rpartition(":")
        out.append((host or "127.0.0.1", int(port)))
    return out


def free_local_addresses(n: int) -> str:
    """`n` loopback addresses on ports free right now (for a group on one machine)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
    finally:
        for s in socks:
            s.close()


class TcpCommunicator(Communicator):
    def __init__(self, addresses: list[tuple[str, int]], rank: int, timeout_s: float, assemble_s: float | None = None):
        """`timeout_s`: a collective's wait for its peers; `assemble_s` (default: the same): the connections'."""
        self.rank, self.world, self.timeout_s = rank, len(addresses), timeout_s
        assemble_s = timeout_s if assemble_s is None else assemble_s
        self.traffic = Traffic()
        self._error: str | None = None
        self._peers: dict[int, socket.socket] = {}
        deadline = time.monotonic() + assemble_s
        listener = socket.create_server(addresses[rank], reuse_port=False)
        try:
            for r in range(rank):  # connect to every lower rank, retrying while it starts
                self._peers[r] = self._connect(addresses[r], deadline)
            listener.settimeout(max(0.1, deadline - time.monotonic()))
            while len(self._peers) < self.world - 1:
                conn, _ = listener.accept()
                conn.settimeout(None)
                (peer,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
                self._peers[int(peer)] = conn
        except OSError as e:
            self.close()
            raise RuntimeError(f"rank {rank}: the group did not assemble within {assemble_s:g} s ({e})") from e
        finally:
            listener.close()
        for s in self._peers.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        self._sel = selectors.DefaultSelector()

    def _connect(self, addr: tuple[str, int], deadline: float) -> socket.socket:
        while True:
            try:
                s = socket.create_connection(addr, timeout=max(0.1, deadline - time.monotonic()))
                s.settimeout(None)
                s.sendall(_LEN.pack(self.rank))
                return s
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    # --- failure -----------------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self._error is not None

    def fail(self, why: str) -> None:
        if self._error is None:
            self._error = f"rank {self.rank} (pid {os.getpid()}): {why}"
            self.close()  # the peers see the connection close and stop waiting

    def errors(self) -> list[str]:
        return [self._error] if self._error else []

    def close(self) -> None:
        for s in self._peers.values():
            s.close()
        self._peers = {}

    # --- the exchange ----------------------------------------------------------------------------
    def _exchange(self, data: np.ndarray) -> list[np.ndarray]:
        payload = memoryview(_LEN.pack(data.size) + data.tobytes())
        out: dict[int, memoryview] = {}  # rank -> what remains to send
        into: dict[int, bytearray] = {}  # rank -> bytes received so far (length first)
        sel, t0 = self._sel, time.perf_counter()
        for r, s in self._peers.items():
            out[r], into[r] = payload, bytearray()
            sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, r)
        pending = set(self._peers)
        try:
            while pending or any(len(v) for v in out.values()):
                left = self.timeout_s - (time.perf_counter() - t0)
                if left <= 0:
                    late = min(pending) if pending else min(r for r, v in out.items() if len(v))
                    raise RuntimeError(f"rank {late} did not answer within {self.timeout_s:g} s")
                for key, events in sel.select(min(left, 1.0)):
                    r, s = key.data, key.fileobj
                    try:
                        self._move(r, s, events, out, into, pending)
                    except ConnectionError as e:
                        raise RuntimeError(f"rank {r} closed its connection (it failed or died: {e.strerror})") from e
                    if not len(out[r]) and r not in pending:
                        sel.unregister(s)
        finally:
            for key in list(sel.get_map().values()):
                sel.unregister(key.fileobj)
        self.traffic.wait_s += time.perf_counter() - t0
        parts = [data if r == self.rank else np.frombuffer(into[r], np.uint8, offset=_LEN.size)
                 for r in range(self.world)]
        self._count(data.size, parts)
        return parts

    def _move(self, r: int, s: socket.socket, events: int, out: dict, into: dict, pending: set) -> None:
        """Send to and receive from rank `r` what its socket is ready for."""
        if events & selectors.EVENT_WRITE and len(out[r]):
            out[r] = out[r][s.send(out[r]):]
        if events & selectors.EVENT_READ and r in pending:
            # never past this message: the peer may already have sent the next one
            got = into[r]
            need = _LEN.size - len(got) if len(got) < _LEN.size else _remaining(got)
            chunk = s.recv(min(need, 1 << 20))
            if not chunk:
                raise ConnectionResetError(0, "end of stream")
            got += chunk
            if len(got) >= _LEN.size and not _remaining(got):
                pending.discard(r)


def _remaining(msg: bytearray) -> int:
    """Bytes of a length-prefixed message still to come."""
    return _LEN.size + _LEN.unpack_from(msg)[0] - len(msg)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise OSError("connection closed during the handshake")
        buf += chunk
    return buf
