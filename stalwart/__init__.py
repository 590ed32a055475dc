"""stalwart: fault-tolerant distributed PyTorch training on Kubernetes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.restart import CallWrapper, NonRetryable, RestartInterrupt, restartable

__all__ = ["CallWrapper", "NonRetryable", "RestartInterrupt", "restartable"]

_LAZY = {"restartable", "CallWrapper", "NonRetryable", "RestartInterrupt"}


def __getattr__(name: str) -> Any:
    # Lazy, so that `import stalwart` (the CLI, the operator) stays light; torch loads only when training.
    if name in _LAZY:
        from stalwart import restart

        return getattr(restart, name)
    raise AttributeError(f"module 'stalwart' has no attribute {name!r}")
