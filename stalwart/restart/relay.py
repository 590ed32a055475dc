"""A rank's side of its agent's barrier relay (:mod:`stalwart.api.relay`): ask, or say it could not.

The relay only saves etcd requests; it never decides anything. So every failure here (no agent listening,
no answer within ``timeout``, a line that does not parse, an answer ``ok: false``) returns ``None`` and the
caller makes the request itself. After a failure that is not etcd's (the agent is gone, slow or confused)
the client stays off for the rest of its session (one per round): a relay that failed once costs its rank no
second wait.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from pydantic import ValidationError

from stalwart.api.relay import MAX_FRAME_BYTES, RelayAnswer, RelayRequest

log = logging.getLogger(__name__)

__all__ = ["RelayClient"]


class RelayClient:
    """Requests to the agent's relay at ``path``, one at a time (thread-safe), each answered within
    ``timeout`` seconds or not at all."""

    def __init__(self, path: str, *, timeout: float = 3.0, context: str = "") -> None:
        if timeout <= 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout}")
        self.path = path
        self.timeout = timeout
        self.context = context
        self.off = False
        self._sock: socket.socket | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    def ask(self, request: RelayRequest) -> RelayAnswer | None:
        """The agent's answer to ``request``, if it gave one and it is ``ok``; else ``None``."""
        if self.off:
            return None
        with self._lock:
            if self.off:  # another thread gave up while this one waited for the lock
                return None
            try:
                answer = self._ask(request)
            except (OSError, ValueError, ValidationError) as e:
                self._give_up(f"{type(e).__name__}: {e}")
                return None
        if not answer.ok:
            log.info("%s: the agent could not relay this request (%s); making it alone", self.context,
                     answer.reason)
            return None
        return answer

    def close(self) -> None:
        with self._lock:
            self._close()

    def _ask(self, request: RelayRequest) -> RelayAnswer:
        deadline = time.monotonic() + self.timeout
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock, self._buffer = sock, b""
        self._sock.settimeout(self.timeout)
        self._sock.sendall(request.model_dump_json(by_alias=True).encode() + b"\n")
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {self.timeout:g} s")
            self._sock.settimeout(left)
            data = self._sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the agent closed the connection")
            self._buffer += data
            if len(self._buffer) > MAX_FRAME_BYTES:
                raise ValueError(f"answer longer than {MAX_FRAME_BYTES} bytes")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return RelayAnswer.model_validate_json(line)

    def _give_up(self, why: str) -> None:
        log.warning("%s: barrier relay at %s failed (%s); this process goes to etcd alone from now on",
                    self.context, self.path, why)
        self.off = True
        self._close()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
