"""The composable policies of an in-process restart, each validated when constructed.

Each policy is a callable over a :class:`IterationContext` (what the iteration is: rank, world size, the
torch Store of the iteration, ...):

* :class:`Initialize` runs before the training function of each iteration (default: build the default
  process group from the iteration's Store, :class:`InitProcessGroup`).
* :class:`Abort` runs after an interruption, before the next barrier (default: :class:`AbortProcessGroup`,
  which frees peers blocked in gloo collectives by closing the group's connections, aborts NCCL
  communicators, and destroys the group).
* :class:`Finalize` runs after an interruption too, after Abort (user clean-up hooks).
* :class:`HealthCheck` runs after Abort; raising :class:`Unhealthy` takes the process out of the job
  (default: :class:`CudaHealthCheck`, a no-op without CUDA).

:func:`Compose` chains several policies of one kind, in order, into a policy of that kind. Each kind is an
abstract base class: a policy is an instance of exactly one of them, so :class:`RestartConfig` refuses a
policy of the wrong kind, a chain included.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from stalwart.api.base import positive_seconds
from stalwart.restart.sockets import SocketSnapshot, shutdown_sockets_since

if TYPE_CHECKING:
    from stalwart.etcd.torch_store import EtcdTorchStore

log = logging.getLogger(__name__)

__all__ = [
    "Abort",
    "AbortProcessGroup",
    "Compose",
    "CudaHealthCheck",
    "FaultCounter",
    "Finalize",
    "FinalizeCallback",
    "GroupArgs",
    "HealthCheck",
    "InitProcessGroup",
    "Initialize",
    "IterationContext",
    "Policy",
    "ProcessGroupState",
    "Unhealthy",
    "group_released_last",
]


class Unhealthy(Exception):
    """A health check failed: this process must leave the job (exit code ``UNHEALTHY``)."""


@dataclass(frozen=True, slots=True)
class GroupArgs:
    """How a default process group is built: the backend, the collective timeout (seconds), and torch's
    ``pg_options`` and ``device_id`` when given."""

    backend: str
    timeout: float
    pg_options: Any = None
    device_id: Any = None


@dataclass(slots=True)
class ProcessGroupState:
    """The default process group of one iteration as the policies build and tear it down. One object per
    iteration, shared by every :class:`IterationContext` of it (the monitor thread frees blocked peers from
    it while the main thread runs)."""

    #: Filled by Initialize: the sockets open before the group was built (the group's are those opened since).
    sockets_before: SocketSnapshot | None = None
    #: The backend of the group being built or last built (NCCL communicators are aborted, gloo's sockets shut).
    backend: str | None = None
    #: The NCCL communicators were aborted already (abort once).
    nccl_aborted: bool = False
    #: How the default group of this iteration was built (set by :func:`build_default_group`).
    built: GroupArgs | None = None
    #: Groups built in this iteration so far (each from a fresh scope of the iteration's Store).
    builds: int = 0
    #: Groups the training function destroyed: held until its frames are gone (see group_released_last).
    retired: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class IterationContext:
    """One iteration as the policies see it. ``store`` is the iteration's torch.distributed Store; ``group``
    the state of its default process group (the one part that changes while the iteration runs). After a
    fault the wrapper hands Abort, Finalize and HealthCheck a copy with ``fault`` and ``own_faults`` set."""

    iteration: int
    slot: int
    rank: int
    world_size: int
    store: EtcdTorchStore
    #: The process's local rank on its node (the CUDA device of an NCCL group built without ``device_id``).
    local_rank: int = 0
    #: Peers (host, port) whose connections are not the process group's (etcd): never shut down.
    keep_peers: tuple[tuple[str, int], ...] = ()
    #: What interrupted the iteration, for Finalize and HealthCheck (None while it runs).
    fault: BaseException | None = None
    #: The number of faults this process has raised itself (for FaultCounter).
    own_faults: int = 0
    #: How the training function asked for the default group in an earlier iteration (it calls
    #: ``init_process_group`` itself): InitProcessGroup builds it that way from the start.
    group_args: GroupArgs | None = None
    group: ProcessGroupState = field(default_factory=ProcessGroupState)


class Policy(ABC):
    """A step of the restart loop over an :class:`IterationContext`. Each kind below is one step; a policy
    is an instance of exactly one kind, so a configuration can check it was given the right one."""

    @abstractmethod
    def __call__(self, ctx: IterationContext) -> None: ...


class Initialize(Policy):
    """Runs before the training function in every iteration."""


class Abort(Policy):
    """Tears down what an interrupted iteration left (process groups, communicators). Must not block on
    peers: it runs while they may be dead or hung."""


class Finalize(Policy):
    """Runs after Abort, before the health check and the next iteration."""


class HealthCheck(Policy):
    """Raises :class:`Unhealthy` when this process should not take part in the next iteration."""


KINDS: tuple[type[Policy], ...] = (Initialize, Abort, Finalize, HealthCheck)

K = TypeVar("K", Initialize, Abort, Finalize, HealthCheck)


def _kind_of(policy: object, i: int) -> type[Policy]:
    kinds = [k for k in KINDS if isinstance(policy, k)]
    if len(kinds) != 1:
        what = "is not a policy" if not kinds else f"is of several kinds ({', '.join(k.__name__ for k in kinds)})"
        raise TypeError(f"Compose: policy #{i} ({policy!r}) {what}: expected an Initialize, Abort, Finalize or "
                        "HealthCheck")
    return kinds[0]


def Compose(*policies: K) -> K:  # a factory under the name of the composition it makes
    """Chain several policies of one kind into one policy of that kind, run in order: an Abort chain runs
    every member even when one fails (and then raises the first error); other chains stop at the first
    error. Policies of different kinds cannot be chained (TypeError naming them): the chain is a policy of
    its members' kind only, so a configuration still refuses it where another kind is expected."""
    if not policies:
        raise ValueError("Compose: give at least one policy")
    kinds = [_kind_of(p, i) for i, p in enumerate(policies)]
    if len(set(kinds)) > 1:
        raise TypeError(f"Compose: expected policies of one kind, got {', '.join(k.__name__ for k in kinds)}")
    chain = next(c for c in _CHAINS if issubclass(c, kinds[0]))(policies)
    return chain  # type: ignore[return-value]  # the chain of K's kind is a K


class _Chain(Policy):
    def __init__(self, policies: Sequence[Policy]) -> None:
        self.policies = tuple(policies)

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.policies))})"

    def __call__(self, ctx: IterationContext) -> None:
        for p in self.policies:
            p(ctx)


class _InitializeChain(_Chain, Initialize):
    pass


class _AbortChain(_Chain, Abort):
    def __call__(self, ctx: IterationContext) -> None:
        first: BaseException | None = None
        for p in self.policies:
            try:
                p(ctx)
            except Exception as e:
                log.warning("abort policy %r failed: %s", p, e)
                first = first or e
        if first is not None:
            raise first


class _FinalizeChain(_Chain, Finalize):
    pass


class _HealthCheckChain(_Chain, HealthCheck):
    pass


_CHAINS: tuple[type[_Chain], ...] = (_InitializeChain, _AbortChain, _FinalizeChain, _HealthCheckChain)


class InitProcessGroup(Initialize):
    """Builds the default process group of the iteration from the iteration's Store.

    ``backend``: ``"gloo"``, ``"nccl"``, or ``"auto"`` (nccl when CUDA is available, else gloo).
    ``timeout``: the collective timeout in seconds (it is not shortened to make restarts fast).
    """

    def __init__(self, backend: Literal["auto", "gloo", "nccl"] = "auto", timeout: float = 1800.0) -> None:
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"InitProcessGroup.backend: expected 'auto', 'gloo' or 'nccl', got {backend!r}")
        self.backend = backend
        self.timeout = positive_seconds("InitProcessGroup.timeout", timeout)

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"

    def __call__(self, ctx: IterationContext) -> None:
        build_default_group(ctx, ctx.group_args or GroupArgs(self.resolved_backend(), self.timeout))


def build_default_group(ctx: IterationContext, args: GroupArgs, init: Callable[..., None] | None = None) -> None:
    """Build the default process group of the iteration as ``args`` say, from the iteration's Store (a fresh
    scope of it for every group after the first, so that no key of an earlier group is read). ``init`` is
    torch's ``init_process_group`` (pass the original while a stand-in replaces it)."""
    import torch
    from torch.distributed import distributed_c10d

    group = ctx.group
    if "nccl" in args.backend and args.device_id is None and torch.cuda.is_available():
        torch.cuda.set_device(ctx.local_rank % max(1, torch.cuda.device_count()))
    if group.sockets_before is None:
        group.sockets_before = SocketSnapshot()
    group.backend = args.backend
    group.nccl_aborted = False
    store = ctx.store if group.builds == 0 else distributed_c10d.PrefixStore(f"group-{group.builds}/", ctx.store)
    if not distributed_c10d.is_initialized():
        # torch names the default group after a counter that destroy_process_group() resets; an earlier
        # init that failed left it raised, and the ranks would then look for each other under different names
        # (each waiting for keys the others never write). Reset it as destroy_process_group() does.
        distributed_c10d._world.group_count = 0
    group.builds += 1
    (init or distributed_c10d.init_process_group)(
        args.backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
        timeout=datetime.timedelta(seconds=args.timeout), pg_options=args.pg_options, device_id=args.device_id)
    group.built = args


class AbortProcessGroup(Abort):
    """Frees peers and tears the default process group down without waiting on any peer.

    1. shuts down the group's TCP connections (gloo; see :mod:`stalwart.restart.sockets`) and aborts its
       NCCL communicators (``ProcessGroup.abort``) when the backend is NCCL (:func:`free_blocked_peers`,
       which the monitor thread also calls the moment it interrupts the iteration);
    2. destroys the default group so the next iteration can build a new one.
    """

    def __call__(self, ctx: IterationContext) -> None:
        free_blocked_peers(ctx)
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        dist.destroy_process_group()


@contextlib.contextmanager
def group_released_last(retired: list[Any] | None = None, *, collect: bool = False) -> Iterator[None]:
    """Hold the default process group while the block drops the rest (the group's destruction, DDP, the
    frames of a failed iteration), then drop the group, and the ``retired`` ones the training function
    destroyed itself (held since): last, from their Python objects.

    torch destroys a process group from its Python object with the GIL released, but from DDP's reducer with
    the GIL held; a gloo worker thread that is still dropping a work object of the last collective needs the
    GIL for it, and the group's destructor joins that thread: deadlock. Held here, the group outlives the
    reducer and goes the first way. (DDP kept alive in a reference cycle keeps the group until the garbage
    collector runs, by which time its threads are idle.) ``collect`` runs the collector first, so that such a
    group goes now too: at the end of a job, where a group left for the interpreter's exit would meet its
    worker thread still busy ("terminate called without an active exception"). It costs about 0.2 s with
    torch loaded, too much for every restart.
    """
    import torch.distributed as dist

    group = dist.group.WORLD
    try:
        yield
        if collect:
            gc.collect()
    finally:
        del group
        if retired is not None:
            retired.clear()


def free_blocked_peers(ctx: IterationContext) -> int:
    """Free this process and its peers from blocked collectives, from any thread, without waiting: shut down
    the process group's TCP connections (gloo) and abort its NCCL communicators. Idempotent."""
    group = ctx.group
    if group.sockets_before is None:
        return 0
    n = shutdown_sockets_since(group.sockets_before, keep_peers=ctx.keep_peers)
    if n:
        log.info("rank %d iteration %d: shut down %d process-group connection(s)", ctx.rank, ctx.iteration, n)
    if "nccl" in (group.backend or "") and not group.nccl_aborted:
        group.nccl_aborted = True
        try:
            _abort_nccl()
        except Exception as e:
            log.warning("iteration %d: NCCL abort failed: %s", ctx.iteration, e)
    return n


def _abort_nccl() -> None:
    import torch.distributed as dist

    pg = dist.group.WORLD
    if pg is None:
        return
    abort = getattr(pg, "abort", None)
    if callable(abort):
        abort()
        return
    backend = pg._get_backend(__import__("torch").device("cuda"))
    backend.abort()


class FinalizeCallback(Finalize):
    """Calls ``fn(ctx)`` after each interruption (e.g. to drop references to the old model)."""

    def __init__(self, fn: Callable[[IterationContext], None]) -> None:
        if not callable(fn):
            raise TypeError(f"FinalizeCallback.fn: expected a callable, got {fn!r}")
        self.fn = fn

    def __call__(self, ctx: IterationContext) -> None:
        self.fn(ctx)


class CudaHealthCheck(HealthCheck):
    """When CUDA is present: synchronizes the device within ``timeout`` seconds; a CUDA error or a device
    that does not answer makes the process :class:`Unhealthy`. Without CUDA it does nothing."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = positive_seconds("CudaHealthCheck.timeout", timeout)

    def __call__(self, ctx: IterationContext) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        error: list[BaseException] = []

        def probe() -> None:
            try:
                torch.cuda.synchronize()
                torch.zeros(1, device="cuda").add_(1).item()
            except BaseException as e:
                error.append(e)

        t = threading.Thread(target=probe, name="stalwart-cuda-health", daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            raise Unhealthy(f"CUDA device did not synchronize within {self.timeout}s")
        if error:
            raise Unhealthy(f"CUDA health check failed: {error[0]}")


class FaultCounter(HealthCheck):
    """Makes a process :class:`Unhealthy` once it raised more than ``max_faults`` faults itself (a rank
    that keeps failing is more likely broken than unlucky)."""

    def __init__(self, max_faults: int) -> None:
        if isinstance(max_faults, bool) or not isinstance(max_faults, int) or max_faults < 0:
            raise ValueError(f"FaultCounter.max_faults: expected an int >= 0, got {max_faults!r}")
        self.max_faults = max_faults

    def __call__(self, ctx: IterationContext) -> None:
        if ctx.own_faults > self.max_faults:
            raise Unhealthy(f"this process raised {ctx.own_faults} faults (max_faults={self.max_faults})")
