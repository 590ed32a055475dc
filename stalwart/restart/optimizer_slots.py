"""An optimizer's state slots made before a copy needs them, so that the copy lands in memory already touched.

A promoted spare's optimizer has no state until its first step, so :func:`~.peers.sync_from_peers` makes its
slots (momentum, Adam's moments) as the bytes arrive: the kernel hands out and zeroes every page of them on the
copy's critical path (about 0.3 s for 800 MB here, as much as the wire itself). A parked spare has time to
spare: :func:`materialize_optimizer_state`, called from the decorator's ``prepare`` hook, makes them there,
the way torch's distributed checkpoint does before it loads into a fresh optimizer (one ``step`` with zero
gradients and every group's learning rate 0: the parameters do not move, every slot exists).

The slots it made are *placeholders* (the optimizer's state as a fresh one would be differs: Adam's step count
is 1), so a rank never trains on them. :func:`settle` is called by every :func:`~.peers.sync_from_peers`:
where the copy filled the optimizer (this rank received), the placeholders are real state now and are
forgotten; where it did not (no rank held state, this rank was a source, or a rank that left the copy early),
the placeholders still in the optimizer are dropped, and it is as fresh as it was. State the caller put in
since (``load_state_dict`` replaces the whole state) is never touched.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from stalwart.api import pod_env

if TYPE_CHECKING:
    import torch

__all__ = ["materialize_optimizer_state", "placeholders", "settle"]

log = logging.getLogger(__name__)

# Per optimizer: for each parameter whose state was made here, its slots' tensors by key (weakly: state the
# caller replaced must not be kept alive by this record; a slot is a placeholder while it *is* that tensor).
_MADE: weakref.WeakKeyDictionary[Any, list[tuple[weakref.ref[Any], dict[str, weakref.ref[Any]]]]] = \
    weakref.WeakKeyDictionary()


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Make ``optimizer``'s state slots now, as placeholders a later :func:`~.peers.sync_from_peers` receives
    into (or drops when it copies nothing). Call it where the model and optimizer are built before the world
    is known (the ``prepare`` hook) on a parked spare, whose time is free.

    Does nothing, and returns ``False``, when the optimizer already has state or a parameter already has a
    gradient (it is in use), or when its step raised (one that needs a closure; logged, the state left empty);
    returns ``True`` when it made slots. The parameters are left as they were for
    optimizers whose update scales with the learning rate (all of ``torch.optim``'s)."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return False
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    rates = [g.get("lr") for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            optimizer.step()
    except Exception as e:  # any optimizer's step: what it made half-way must not be trained on
        # One that needs a closure (LBFGS), or whose step refuses zero gradients: the copy makes the slots, as
        # it would without this call; the spare is not failed for a speed-up.
        optimizer.state.clear()
        log.warning("%s pid %d: cannot make the slots of %s ahead of a copy (its step raised %s: %s); the copy "
                    "will make them", _where(), os.getpid(), type(optimizer).__name__, type(e).__name__, e)
        return False
    finally:
        for g, lr in zip(optimizer.param_groups, rates, strict=True):
            if lr is not None:
                g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    made = []
    nbytes = 0
    for p in params:
        slots = {k: v for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
        if slots:
            made.append((weakref.ref(p), {k: weakref.ref(v) for k, v in slots.items()}))
            nbytes += sum(v.numel() * v.element_size() for v in slots.values())
    _MADE[optimizer] = made
    log.info("%s pid %d: made the optimizer's state slots ahead of a copy: %d parameters, %.1f MB", _where(),
             os.getpid(), len(made), nbytes / 1e6)
    return bool(made)


def placeholders(optimizer: Any) -> list[tuple[Any, str]]:
    """The (parameter, key) slots of ``optimizer`` still holding what :func:`materialize_optimizer_state` made."""
    out: list[tuple[Any, str]] = []
    for p_ref, slots in _MADE.get(optimizer, []):
        p = p_ref()
        state = optimizer.state.get(p) if p is not None else None
        if state:
            out += [(p, k) for k, r in slots.items() if (t := r()) is not None and state.get(k) is t]
    return out


def settle(optimizer: Any, filled: Collection[tuple[Any, str]] | None) -> None:
    """After a copy: ``filled`` (the slots the copy wrote, when this rank received) are real state from now
    on; every other placeholder is dropped (``filled`` None: the copy wrote none). Nothing to do for an
    optimizer :func:`materialize_optimizer_state` never saw."""
    if optimizer is None or optimizer not in _MADE:
        return
    import torch

    written = {(id(p), k) for p, k in filled or ()}
    dropped = 0
    for p, key in placeholders(optimizer):
        if (id(p), key) in written:
            continue
        state = optimizer.state[p]
        del state[key]
        dropped += 1
        if not any(isinstance(v, torch.Tensor) for v in state.values()):
            del optimizer.state[p]  # what is left (a count) was made with the slots
    del _MADE[optimizer]
    if dropped:
        log.info("%s pid %d: dropped %d optimizer slots made ahead of a copy that did not fill them", _where(),
                 os.getpid(), dropped)


def _where() -> str:
    """The job and pod of this process, for its log lines (a parked process has no rank yet)."""
    return f"job {os.environ.get(pod_env.JOB, '-')} pod {os.environ.get(pod_env.NODE_ID, '-')}"

