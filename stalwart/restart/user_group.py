"""A training function that calls ``init_process_group`` itself, as scripts written for torchrun do.

Under :func:`stalwart.restartable` the default process group of each iteration is built by the wrapper, from
the iteration's etcd Store (fenced by the rendezvous round): that is what lets an iteration start again in
the same process. A function written for torchrun calls ``dist.init_process_group(...)`` first, and often
``dist.destroy_process_group()`` last. While the function runs, :class:`InitStandIn` takes the place of
``torch.distributed.init_process_group`` (in ``torch.distributed``, in ``distributed_c10d`` and under any name
the function's module bound it to with ``from torch.distributed import init_process_group``), and
:func:`decide` says what a call means:

* **reuse**: the group of the iteration fits the call (no backend or the same, no timeout or the same, no
  ``pg_options``/``device_id`` or the same): the call returns at once (one log line per process);
* **rebuild**: the call asks for another backend, timeout, ``pg_options`` or ``device_id``: the iteration's
  group is destroyed and built again that way (every rank runs the same call, so they rebuild together),
  and later iterations are built that way from the start, so the call is a reuse from then on;
* **build**: no group exists (the function destroyed it, or the ``initialize`` policy builds none);
* a ``rank`` or ``world_size`` that contradicts the iteration's raises :class:`ProcessGroupConflict`, which
  fails the job (a restart cannot change the call).

``init_method`` (``env://``, ``tcp://...``) and ``store`` are not used: a group always bootstraps from the
iteration's etcd Store. ``destroy_process_group`` destroys the group as usual; the stand-in only keeps the
group's Python object until the function's frames are gone, so that DDP, dropped with them, does not destroy
the group while holding the GIL (a deadlock with a gloo thread still dropping its last work object: see
:func:`~stalwart.restart.policies.group_released_last`). The wrapper does not tear down a group the function
destroyed itself.
"""

from __future__ import annotations

import datetime
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from stalwart.restart.errors import ProcessGroupConflict
from stalwart.restart.policies import GroupArgs, IterationContext, build_default_group

log = logging.getLogger(__name__)

__all__ = ["InitCall", "InitStandIn", "Plan", "decide"]

_HINT = ("ranks and world sizes can change between in-process restarts: take them from dist.get_rank() and "
         "dist.get_world_size(), or from RANK and WORLD_SIZE, which stalwart sets for every iteration")


@dataclass(frozen=True, slots=True)
class InitCall:
    """The arguments of one ``init_process_group`` call, normalised (timeout in seconds, backend lower case;
    ``-1`` is torch's "not given" for rank and world size)."""

    backend: str | None = None
    init_method: str | None = None
    timeout: float | None = None
    world_size: int = -1
    rank: int = -1
    store: bool = False
    pg_options: Any = None
    device_id: Any = None

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> InitCall:
        backend = arguments.get("backend")
        timeout = arguments.get("timeout")
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        return cls(backend=None if backend is None else str(backend).lower(),
                   init_method=arguments.get("init_method"),
                   timeout=None if seconds is None else float(seconds),
                   world_size=int(arguments.get("world_size", -1)), rank=int(arguments.get("rank", -1)),
                   store=arguments.get("store") is not None, pg_options=arguments.get("pg_options"),
                   device_id=arguments.get("device_id"))

    def describe(self) -> str:
        parts = [f"{name}={value!r}" for name, value in (
            ("backend", self.backend), ("init_method", self.init_method), ("timeout", self.timeout),
            ("pg_options", self.pg_options), ("device_id", self.device_id)) if value is not None]
        parts += [f"{name}={value}" for name, value in (("world_size", self.world_size), ("rank", self.rank))
                  if value != -1]
        if self.store:
            parts.append("store=...")
        return f"init_process_group({', '.join(parts)})"


@dataclass(frozen=True, slots=True)
class Plan:
    """What a call does: ``action`` on the default group, built with ``args``; ``unused`` names the
    arguments that have no effect under stalwart (the bootstrap: the iteration's etcd Store is used)."""

    action: Literal["reuse", "rebuild", "build"]
    args: GroupArgs | None
    unused: tuple[str, ...] = ()


def decide(call: InitCall, *, exists: bool, built: GroupArgs | None, fallback: GroupArgs, rank: int,
           world_size: int) -> Plan:
    """What ``call`` means in an iteration that runs ``rank`` of ``world_size``. ``exists``: a default group
    exists; ``built``: how the wrapper built it (``None`` when it did not: it is then used as it is);
    ``fallback``: the wrapper's own way to build one. Raises :class:`ProcessGroupConflict`."""
    if call.rank not in (-1, rank):
        raise ProcessGroupConflict(f"{call.describe()}: this iteration runs rank {rank} of world size "
                                   f"{world_size}; {_HINT}")
    if call.world_size not in (-1, world_size):
        raise ProcessGroupConflict(f"{call.describe()}: this iteration's world size is {world_size}; {_HINT}")
    unused = tuple(name for name, given in (("init_method", call.init_method is not None),
                                            ("store", call.store)) if given)
    if exists and built is None:
        return Plan("reuse", None, unused)
    base = built or fallback
    wanted = GroupArgs(
        backend=call.backend or base.backend,
        timeout=base.timeout if call.timeout is None else call.timeout,
        pg_options=base.pg_options if call.pg_options is None else call.pg_options,
        device_id=base.device_id if call.device_id is None else call.device_id)
    if not exists:
        return Plan("build", wanted, unused)
    return Plan("reuse" if wanted == built else "rebuild", wanted, unused)


class InitStandIn:
    """Stands in for ``init_process_group`` while the training function runs (see the module docstring).

    ``install`` and ``restore`` may be interrupted halfway (the wrapper calls ``restore`` whatever happened):
    every replacement made is recorded before the next is made, and ``restore`` undoes exactly those.
    """

    def __init__(self, ctx: IterationContext, *, fallback: GroupArgs, learn: Callable[[GroupArgs], None],
                 deadline: Callable[[], Any], fn_globals: dict[str, Any] | None) -> None:
        from torch.distributed import distributed_c10d

        self.ctx = ctx
        self.fallback = fallback
        self.learn = learn
        self.deadline = deadline
        self.fn_globals = fn_globals
        self.original: Callable[..., None] = distributed_c10d.init_process_group
        self.original_destroy: Callable[..., None] = distributed_c10d.destroy_process_group
        self.signature = inspect.signature(self.original)
        self._replaced: list[tuple[Any, str, Any]] = []
        self._said = False

    def install(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        stand_ins: dict[str, tuple[Any, Any]] = {"init_process_group": (self.original, self),
                                                 "destroy_process_group": (self.original_destroy, self.destroy)}
        for target in (distributed_c10d, dist):
            for name, (original, stand_in) in stand_ins.items():
                if getattr(target, name, None) is original:
                    self._replaced.append((target, name, original))
                    setattr(target, name, stand_in)
        if self.fn_globals is not None:
            by_original = {id(original): stand_in for original, stand_in in stand_ins.values()}
            for name, value in list(self.fn_globals.items()):
                if id(value) in by_original:
                    self._replaced.append((self.fn_globals, name, value))
                    self.fn_globals[name] = by_original[id(value)]

    def restore(self) -> None:
        while self._replaced:
            target, name, original = self._replaced.pop()
            if isinstance(target, dict):
                target[name] = original
            else:
                setattr(target, name, original)

    def destroy(self, group: Any = None) -> None:
        """``destroy_process_group`` as the training function calls it; the default group's Python object is
        kept (in the iteration context) until the wrapper drops it, after the function's frames."""
        import torch.distributed as dist

        if group is None or group is dist.group.WORLD:
            default = dist.group.WORLD
            if default is not None:
                self.ctx.group.retired.append(default)
        self.original_destroy(group)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        from torch.distributed import distributed_c10d

        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"init_process_group: {e}") from None
        call = InitCall.of(bound.arguments)
        ctx = self.ctx
        exists = distributed_c10d.is_initialized()
        plan = decide(call, exists=exists, built=ctx.group.built if exists else None, fallback=self.fallback,
                      rank=ctx.rank, world_size=ctx.world_size)
        unused = f" ({', '.join(plan.unused)} not used: groups bootstrap from the iteration's etcd Store)" \
            if plan.unused else ""
        if plan.action == "reuse":
            level = logging.DEBUG if self._said else logging.INFO
            self._said = True
            log.log(level, "slot %d iteration %d: %s in the training function uses the process group stalwart "
                    "built for this iteration (rank %d of %d)%s", ctx.slot, ctx.iteration, call.describe(),
                    ctx.rank, ctx.world_size, unused)
            return
        assert plan.args is not None
        log.info("slot %d iteration %d: %s in the training function: %s the iteration's process group with "
                 "backend %s, timeout %gs%s", ctx.slot, ctx.iteration, call.describe(),
                 "rebuilding" if plan.action == "rebuild" else "building", plan.args.backend, plan.args.timeout,
                 unused)
        if plan.action == "rebuild":
            distributed_c10d.destroy_process_group()
        with self.deadline():
            build_default_group(ctx, plan.args, init=self.original)
        self.learn(plan.args)
