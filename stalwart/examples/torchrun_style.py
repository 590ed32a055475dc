"""A training script written the way torch's examples write it for torchrun, run under ``stalwart agent``.

The training function initialises the default process group itself (``dist.init_process_group("gloo")``)
and, with ``--destroy``, destroys it at its end. Decorated with ``@stalwart.restartable()``, it is re-run in
process after a fault in any rank; the ``init_process_group`` call then returns the process group stalwart
built for the iteration (see :mod:`stalwart.restart.user_group`). The model lives in the function, as in
those examples, so a restart starts training again from step 0 (keep state outside the function, as
:mod:`stalwart.examples.train` does, to resume instead). The decorator passes a ``call_wrapper`` to a function
that has such a parameter, in this style too: each optimizer step is an atomic section and each step pings.

Fault injection (environment): ``STALWART_EXAMPLE_FAIL_AT_STEP=N`` makes rank ``STALWART_EXAMPLE_FAIL_RANK``
(default 1) raise ``ValueError`` at step ``N``, once per process, or at every pass with
``STALWART_EXAMPLE_FAIL_ALWAYS=1`` (a deterministic bug: the job must end ``Failed`` once the in-process
restart budget is spent). Prints one JSON object per line: ``start``, ``fault``, ``done``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stalwart

FAIL_AT_STEP_ENV = "STALWART_EXAMPLE_FAIL_AT_STEP"
FAIL_RANK_ENV = "STALWART_EXAMPLE_FAIL_RANK"
FAIL_ALWAYS_ENV = "STALWART_EXAMPLE_FAIL_ALWAYS"

_failed = False  # this process has raised its injected fault (kept across in-process restarts)


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "time": round(time.time(), 3), **fields}), flush=True)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m stalwart.examples.torchrun_style", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--destroy", action="store_true", help="call destroy_process_group() at the end")
    args = p.parse_args(argv)
    if args.steps <= 0:
        p.error(f"--steps must be a positive integer, got {args.steps}")
    return args


def maybe_fail(rank: int, step: int) -> None:
    global _failed
    at = os.environ.get(FAIL_AT_STEP_ENV)
    if not at or step != int(at) or rank != int(os.environ.get(FAIL_RANK_ENV, "1")):
        return
    if _failed and os.environ.get(FAIL_ALWAYS_ENV) != "1":
        return
    _failed = True
    emit("fault", rank=rank, step=step)
    raise ValueError(f"step {step}: the loss is NaN (injected on rank {rank})")


@stalwart.restartable()
def train(args: argparse.Namespace, call_wrapper: stalwart.CallWrapper | None = None) -> float:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    emit("start", rank=rank, world_size=dist.get_world_size())
    loss = torch.zeros(())
    for step in range(args.steps):
        maybe_fail(rank, step)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + rank))
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        # The update as one unit: an interrupt (a peer's fault) waits for its end instead of leaving the
        # parameters half-updated. Put a step counter kept outside the function in the same section.
        with call_wrapper.atomic() if call_wrapper is not None else contextlib.nullcontext():
            optimizer.step()
        if call_wrapper is not None:
            call_wrapper.ping(step=step + 1)  # progress: the soft timeout's clock and the status's step
    emit("done", rank=rank, step=args.steps, loss=round(float(loss), 6))
    if args.destroy:
        dist.destroy_process_group()
    return float(loss)


def main(argv: Sequence[str] | None = None) -> int:
    train(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
