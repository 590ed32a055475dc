"""A small data-parallel training job on CPU: the example that ``examples/*.yaml`` and ``stalwart demo`` run.

A two-layer network learns a fixed linear map from synthetic batches with DistributedDataParallel over gloo.

Two ways to run it:

* under ``stalwart agent`` (what the operator's pods do; the agent sets ``STALWART_*``): :func:`train` runs
  through ``@stalwart.restartable`` (:func:`restartable_train`), so after a fault anywhere in the job every
  healthy rank re-runs it in process. The model and its optimizer are built by the decorator's ``prepare``
  hook (:func:`prepare`), once per process before its first round: a warm spare builds them while it waits
  parked, so that after its promotion only the process group and the copy of the state from a peer remain;
* as a plain torchrun rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): it runs once; a fault
  ends the process and a fresh start resumes from the checkpoint.

Under the agent, the in-process restart settings (``maxRestarts``, the soft and hard timeouts, the barrier
timeout) come from the TrainingJob's ``restartPolicy.inProcess``: the decorator sets none of them.

One optimizer step and the step counter are one atomic unit (``call_wrapper.atomic()``): an interrupt that
lands between the weights' update and the count would make the step run again after recovery, applied twice.

Recovery, in the order it is tried:

* **in memory**: the model and the step live in this process across in-process restarts; after a restart the
  ranks agree on the most advanced state (the highest step, held by the lowest such rank) and broadcast it;
* **from peers**: a process that starts fresh (a warm spare, a replaced pod) first asks its peers; when one
  holds state in memory, the state comes from it and the checkpoint is not read;
* **checkpoint**: when no rank holds state in memory (the job's start, every process replaced), every rank
  loads ``<checkpoint-dir>/checkpoint.pt``, which rank 0 writes atomically every ``--checkpoint-every`` steps
  (tensors only; loaded with ``weights_only``).

With ``--momentum`` the optimizer has state (each parameter's momentum buffer): it stays in memory across
in-process restarts, goes into the checkpoint, and travels with the model to a rank that lacks it.

Fault injection for demos and tests (environment): ``STALWART_EXAMPLE_FAIL_AT_STEP=N`` makes rank
``STALWART_EXAMPLE_FAIL_RANK`` (default 0) raise :class:`InjectedFault` when it reaches step ``N``, at most
``STALWART_EXAMPLE_FAIL_TIMES`` times (default 1) per checkpoint directory (marker files count the faults, so a
restarted or replaced rank fails again only while the count lasts). ``STALWART_EXAMPLE_DIE_IN_COPY=1`` makes the
first rank that sends its state to a peer (``sync_from_peers``) SIGKILL itself once it has posted the copy's
first bucket (once per checkpoint directory, a marker file): a source dying mid-copy.
``STALWART_EXAMPLE_FAIL_PREPARE=parked`` makes :func:`prepare` raise ``ValueError`` in a parked process (a warm
spare's, or a pod's standby), never in a rank's.

Output: one JSON object per line on stdout, each with its ``time`` (``start``, ``resume``, ``fault``, ``step`` every
``--log-every`` steps, ``done``). ``done`` carries ``params_sha256``, the digest of the final parameters' bytes
(equal on every rank of a correct run), and the parameters themselves as ``params`` only for a model of at most
``PARAMS_IN_DONE`` of them (a 100 M-parameter list would be gigabytes of JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import stalwart
from stalwart.restart import CallWrapper, Restartable, is_parked, materialize_optimizer_state, sync_from_peers
from stalwart.restart.peers import BUCKET_BYTES

log = logging.getLogger("stalwart.examples.train")

FAIL_AT_STEP_ENV = "STALWART_EXAMPLE_FAIL_AT_STEP"
FAIL_RANK_ENV = "STALWART_EXAMPLE_FAIL_RANK"
FAIL_TIMES_ENV = "STALWART_EXAMPLE_FAIL_TIMES"
CHECKPOINT_DIR_ENV = "STALWART_CHECKPOINT_DIR"
CHECKPOINT_NAME = "checkpoint.pt"
FAULT_MARKER = "fault-injected"
DIE_IN_COPY_ENV = "STALWART_EXAMPLE_DIE_IN_COPY"
FAIL_PREPARE_ENV = "STALWART_EXAMPLE_FAIL_PREPARE"
COPY_FAULT_MARKER = "copy-fault-injected"
IN_FEATURES = 16
HIDDEN = 32
#: The largest model whose final parameters the ``done`` line lists (larger ones: the digest only).
PARAMS_IN_DONE = 100_000
OUT_FEATURES = 4
BASE_LR = 0.05


class InjectedFault(RuntimeError):
    """The fault that ``STALWART_EXAMPLE_FAIL_AT_STEP`` asks for."""


@dataclass
class Options:
    steps: int
    batch_size: int
    lr: float
    seed: int
    checkpoint_dir: Path
    checkpoint_every: int
    log_every: int
    step_delay: float
    fail_at_step: int | None
    fail_rank: int
    fail_times: int = 1
    hidden: int = HIDDEN
    momentum: float = 0.0
    #: the step delay applies to the steps before this one only (None: to every step)
    step_delay_until: int | None = None
    #: the step delay ends once this process resumes a job under way (past step 0: a restart, or a spare or a new
    #: process taking a rank), whatever step that is
    step_delay_until_resume: bool = False
    #: the largest bucket of a state copy between peers (``sync_from_peers``'s ``bucket_bytes``)
    copy_bucket_bytes: int = BUCKET_BYTES


@dataclass
class TrainState:
    """What survives an in-process restart: the (unwrapped) model, its optimizer (whose momentum is state a
    restart must keep) and the next step to run."""

    model: nn.Module
    step: int
    optimizer: torch.optim.Optimizer


# The state of this process, kept across in-process restarts of :func:`train`.
_state: TrainState | None = None
# Whether this process has resumed the job past step 0 (``--step-delay-until-resume`` ends the delay then).
_resumed_under_way = False


def _positive(name: str, value: int) -> int:
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def parse_options(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> Options:
    """Options from the command line and the environment; a bad value raises ValueError naming it."""
    env = dict(os.environ) if env is None else env
    parser = argparse.ArgumentParser(prog="python -m stalwart.examples.train", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="total optimizer steps (default 200)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="alternative to --steps: epochs of --steps-per-epoch steps each")
    parser.add_argument("--steps-per-epoch", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=int(env.get("BATCH_SIZE", "32")),
                        help="per-rank batch size (default $BATCH_SIZE or 32)")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"SGD learning rate (default {BASE_LR:g}, times {HIDDEN}/hidden for a wider hidden "
                             "layer: the output layer's update grows with the width, and a fixed rate makes the "
                             "loss of a wide model diverge to NaN)")
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="SGD momentum in [0, 1) (default 0: a stateless optimizer); with momentum the "
                             "optimizer's state is checkpointed and copied to a newcomer with the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=env.get(CHECKPOINT_DIR_ENV),
                        help=f"where rank 0 keeps the checkpoint (default ${CHECKPOINT_DIR_ENV}, "
                             "else a directory per job under the temporary directory)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=HIDDEN,
                        help=f"width of the hidden layer (default {HIDDEN}); the model has "
                             f"{IN_FEATURES + OUT_FEATURES + 1} parameters per unit plus {OUT_FEATURES}")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds to sleep per step, so that a demo can be watched (default 0)")
    parser.add_argument("--step-delay-until", type=int, default=None, metavar="STEP",
                        help="sleep --step-delay after the steps before STEP only, the rest at full speed (a test "
                             "injects its fault while the job is slow and need not wait out the rest; default: "
                             "every step)")
    parser.add_argument("--step-delay-until-resume", action="store_true",
                        help="sleep --step-delay per step only until this process resumes the job past step 0 (after "
                             "a restart, or as a spare or new process taking a rank), then at full speed: a test's "
                             "fault lands while the job is slow however loaded the machine, and the steps after "
                             "the recovery do not wait")
    parser.add_argument("--copy-bucket-bytes", type=int, default=BUCKET_BYTES, metavar="BYTES",
                        help=f"the largest bucket of a state copy from a peer (default {BUCKET_BYTES}): a small "
                             "model still copies in several buckets")
    args = parser.parse_args(argv)
    steps = _positive("--epochs", args.epochs) * _positive("--steps-per-epoch", args.steps_per_epoch) \
        if args.epochs is not None else args.steps
    checkpoint_dir = args.checkpoint_dir or str(
        Path(env.get("TMPDIR", "/tmp")) / "stalwart-checkpoints" / env.get("STALWART_JOB_UID", "local"))
    fail_at: int | None = None
    if env.get(FAIL_AT_STEP_ENV):
        try:
            fail_at = int(env[FAIL_AT_STEP_ENV])
        except ValueError:
            raise ValueError(f"{FAIL_AT_STEP_ENV} must be an integer step, got {env[FAIL_AT_STEP_ENV]!r}") from None
    try:
        fail_rank = int(env.get(FAIL_RANK_ENV, "0"))
    except ValueError:
        raise ValueError(f"{FAIL_RANK_ENV} must be an integer rank, got {env[FAIL_RANK_ENV]!r}") from None
    try:
        fail_times = int(env.get(FAIL_TIMES_ENV, "1"))
    except ValueError:
        fail_times = 0
    if fail_times < 1:
        raise ValueError(f"{FAIL_TIMES_ENV} must be a positive integer, got {env[FAIL_TIMES_ENV]!r}")
    hidden = _positive("--hidden", args.hidden)
    lr = default_lr(hidden) if args.lr is None else args.lr
    if not lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.momentum < 1:
        raise ValueError(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.step_delay < 0:
        raise ValueError(f"--step-delay must be >= 0, got {args.step_delay}")
    return Options(steps=_positive("--steps", steps), batch_size=_positive("--batch-size", args.batch_size),
                   lr=lr, seed=args.seed, checkpoint_dir=Path(checkpoint_dir),
                   checkpoint_every=_positive("--checkpoint-every", args.checkpoint_every),
                   copy_bucket_bytes=_positive("--copy-bucket-bytes", args.copy_bucket_bytes),
                   log_every=_positive("--log-every", args.log_every), step_delay=args.step_delay,
                   fail_at_step=fail_at, fail_rank=fail_rank, fail_times=fail_times,
                   hidden=hidden, momentum=args.momentum,
                   step_delay_until_resume=args.step_delay_until_resume,
                   step_delay_until=None if args.step_delay_until is None
                   else _positive("--step-delay-until", args.step_delay_until))


def default_lr(hidden: int) -> float:
    """The learning rate a model of width ``hidden`` trains stably with: ``BASE_LR`` up to the default width,
    scaled down in proportion beyond it."""
    return BASE_LR * min(1.0, HIDDEN / hidden)


def build_model(seed: int, hidden: int = HIDDEN) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, OUT_FEATURES))


def batch(seed: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of one rank at one step: a pure function of its arguments, so a re-run step sees the same data."""
    target = torch.Generator().manual_seed(seed)
    true_map = torch.randn(IN_FEATURES, OUT_FEATURES, generator=target)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(size, IN_FEATURES, generator=g)
    return x, x @ true_map


def save_checkpoint(directory: Path, model: nn.Module, step: int,
                    optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write the checkpoint atomically: readers see the previous one or this one, never a torn file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_NAME
    tmp = directory / f".{CHECKPOINT_NAME}.{os.getpid()}.tmp"
    data: dict[str, Any] = {"step": torch.tensor(step), "model": model.state_dict()}
    if optimizer is not None:
        data["optimizer"] = optimizer.state_dict()
    torch.save(data, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load the checkpoint into ``model`` (and ``optimizer``, when the checkpoint has its state) and return
    its step; 0 when there is none."""
    path = directory / CHECKPOINT_NAME
    if not path.exists():
        return 0
    data: dict[str, Any] = torch.load(path, weights_only=True)
    model.load_state_dict(data["model"])
    if optimizer is not None and "optimizer" in data:
        optimizer.load_state_dict(data["optimizer"])
    return int(data["step"])


def make_optimizer(model: nn.Module, opts: Options) -> torch.optim.SGD:
    """SGD over the unwrapped model's parameters (DDP shares them), so the optimizer outlives each iteration's
    DDP wrapper."""
    return torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=opts.momentum)


def emit(event: str, **fields: Any) -> None:
    # Wall-clock time, so that recovery can be measured across processes and pods (one machine, one clock).
    print(json.dumps({"event": event, "time": round(time.time(), 3), **fields}), flush=True)


def arm_copy_fault(opts: Options, rank: int) -> None:
    """With ``STALWART_EXAMPLE_DIE_IN_COPY=1``: this process SIGKILLs itself after it posted the first bucket of a
    state copy it sends, unless a process of the job did already (a marker file)."""
    if os.environ.get(DIE_IN_COPY_ENV) != "1":
        return
    from stalwart.restart import copy_wire

    def die(index: int) -> None:
        opts.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(opts.checkpoint_dir / COPY_FAULT_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        emit("fault", rank=rank, step=_state.step if _state is not None else None, count=1, bucket=index)
        os.kill(os.getpid(), signal.SIGKILL)

    copy_wire.after_bucket = die


def maybe_inject_fault(opts: Options, rank: int, step: int) -> None:
    if opts.fail_at_step is None or step != opts.fail_at_step or rank != opts.fail_rank:
        return
    opts.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    for count in range(opts.fail_times):
        try:
            # O_EXCL: each marker is taken once, even when several processes race here.
            os.close(os.open(opts.checkpoint_dir / f"{FAULT_MARKER}-{count}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            continue
    else:
        return
    emit("fault", rank=rank, step=step, count=count + 1)
    raise InjectedFault(f"injected fault at step {step} on rank {rank} ({FAIL_AT_STEP_ENV}={opts.fail_at_step})")


def prepare(opts: Options) -> TrainState:
    """What a rank builds before it knows its world: the model and its optimizer, at step 0 (nothing here
    depends on the rank or the process group)."""
    if os.environ.get(FAIL_PREPARE_ENV) == "parked" and os.environ.get("STALWART_PARKED") == "true":
        raise ValueError(f"the model cannot be built here (injected: {FAIL_PREPARE_ENV}=parked)")
    model = build_model(opts.seed, opts.hidden)
    optimizer = make_optimizer(model, opts)
    if is_parked():
        # A spare waiting to be promoted: its momentum buffers are made now, so that the state copy after its
        # promotion lands in memory already touched instead of making them on the recovery's path.
        materialize_optimizer_state(optimizer)
    return TrainState(model, 0, optimizer)


def train(opts: Options, call_wrapper: CallWrapper | None = None) -> float:
    """Train to ``opts.steps`` within the default process group (the restart wrapper, or :func:`main` in plain
    mode, initialises it). Returns the final loss.

    Safe to call again in the same process after a fault (in-process restart): it continues from the most
    advanced state any rank holds. Progress goes to ``call_wrapper`` when there is one; so does the state
    :func:`prepare` built before the process's first round (``call_wrapper.prepared``), which the first call
    adopts (without it, as in plain mode, the first call builds it).
    """
    global _state, _resumed_under_way
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fresh = _state is None
    if _state is None:
        prepared = call_wrapper.prepared if call_wrapper is not None else None
        _state = prepared if isinstance(prepared, TrainState) else prepare(opts)
    optimizer = _state.optimizer
    # The most advanced replica in memory wins, the optimizer's state (momentum; plain SGD has none) with the
    # model. A newcomer asks its peers before it reads the checkpoint, which it needs only when no rank holds
    # state in memory (the job's start, every process replaced): a warm spare taking a lost rank never reads it.
    arm_copy_fault(opts, rank)
    bucket = opts.copy_bucket_bytes
    synced = sync_from_peers(_state.model, optimizer, step=None if fresh else _state.step, bucket_bytes=bucket)
    if synced.step is None:
        synced = sync_from_peers(_state.model, optimizer, bucket_bytes=bucket,
                                 step=load_checkpoint(opts.checkpoint_dir, _state.model, optimizer))
    _state.step, source = synced.step or 0, synced.source
    _resumed_under_way = _resumed_under_way or _state.step > 0
    if fresh:
        emit("start", rank=rank, world_size=world_size, step=_state.step)
    emit("resume", rank=rank, world_size=world_size, step=_state.step, source=source,
         iteration=call_wrapper.iteration if call_wrapper is not None else 0)
    # Past step 0 the replicas are equal now (one source, or one checkpoint the same step on every rank), so
    # DDP's own broadcast of the whole model at construction is skipped; the decision is the same on every
    # rank (the agreed step). At step 0 it stays: it guards a job whose ranks built their models unseeded.
    ddp = DistributedDataParallel(_state.model, init_sync=_state.step == 0)
    last_loss = float("nan")
    while _state.step < opts.steps:
        step = _state.step
        maybe_inject_fault(opts, rank, step)
        x, y = batch(opts.seed, step, rank, opts.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        # The update and the count together, or neither: a restart between them would apply this step twice.
        with call_wrapper.atomic() if call_wrapper is not None else contextlib.nullcontext():
            optimizer.step()
            _state.step = step + 1
        last_loss = float(loss.detach())
        if call_wrapper is not None:
            call_wrapper.ping(_state.step)
        if rank == 0 and (_state.step % opts.checkpoint_every == 0 or _state.step == opts.steps):
            if call_wrapper is not None:
                # An interruption waits until the checkpoint is whole.
                with call_wrapper.atomic():
                    save_checkpoint(opts.checkpoint_dir, _state.model, _state.step, optimizer)
            else:
                save_checkpoint(opts.checkpoint_dir, _state.model, _state.step, optimizer)
        if _state.step % opts.log_every == 0 or _state.step == opts.steps:
            emit("step", rank=rank, step=_state.step, loss=round(last_loss, 6))
        if opts.step_delay and (opts.step_delay_until is None or _state.step < opts.step_delay_until) and not (
                opts.step_delay_until_resume and _resumed_under_way):
            time.sleep(opts.step_delay)
    emit("done", rank=rank, world_size=world_size, step=_state.step, loss=round(last_loss, 6),
         **final_parameters(_state.model))
    return last_loss


def restartable_train(opts: Options) -> Restartable[[Options], float]:
    """:func:`train` made restartable, with :func:`prepare` for ``opts`` as its ``prepare`` hook (the hook takes
    no arguments, and the options are known once :func:`main` parsed them). The in-process restart settings
    come from the TrainingJob's ``restartPolicy.inProcess``: the decorator sets none of them."""
    return stalwart.restartable(prepare=functools.partial(prepare, opts))(train)


def final_parameters(model: nn.Module) -> dict[str, Any]:
    """``params_sha256`` of the parameters' bytes, and ``params`` (flat) for a model of at most
    :data:`PARAMS_IN_DONE` parameters."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    out: dict[str, Any] = {"params_sha256": digest.hexdigest()}
    if sum(p.numel() for p in model.parameters()) <= PARAMS_IN_DONE:
        out["params"] = [float(v) for p in model.parameters() for v in p.detach().flatten().tolist()]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = parse_options(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("STALWART_JOB"):
        # Under the agent: the wrapper builds the process group of each iteration and restarts in process.
        restartable_train(opts)(opts)
        return 0
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    try:
        train(opts)
    finally:
        # Destroyed from its Python object after DDP is collected: torch then joins the group's threads
        # without holding the GIL, and none outlives the interpreter (see stalwart.restart.policies).
        dist.destroy_process_group()
        gc.collect()
        del group
    return 0


if __name__ == "__main__":
    sys.exit(main())
