"""The operator in a background thread of the current process (its own event loop, kopf unmodified): for
tests, benchmarks and tools that need an operator next to other work. ``stalwart operator`` is the same
:func:`~stalwart.operator.handlers.operate` in the main thread."""

from __future__ import annotations

import asyncio
import threading
import time

from stalwart.operator.handlers import OperatorRunConfig, kube_from_config, operate
from stalwart.operator.kube import Kube


class EmbeddedOperator:
    """``start()`` returns once kopf is ready (or raises); ``stop()`` stops it and its threads."""

    def __init__(self, config: OperatorRunConfig, kubeconfig: str | None) -> None:
        self.config = config
        self.kube: Kube = kube_from_config(kubeconfig, config.concurrency)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="stalwart-operator", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(operate(self.config, self.kube, stop_flag=self._stop, ready_flag=self._ready))
        except BaseException as e:  # reported by start() and stop()
            self._error = e

    def start(self, timeout: float = 60.0) -> EmbeddedOperator:
        if timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the operator stopped while starting: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the operator was not ready within {timeout:g}s")
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop kopf (daemons are cancelled after their grace), then the API client's threads. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.kube.close()
        if self._thread.is_alive():
            raise RuntimeError(f"the operator did not stop within {timeout:g}s")

    def __enter__(self) -> EmbeddedOperator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
