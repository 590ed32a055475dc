"""A sharded training job on CPU: an MLP split over the ranks with FSDP2 (``fully_shard``) and Adam, whose
state survives a lost pod from peer snapshots, without reading a checkpoint.

Every iteration (stalwart runs :func:`train` again in the same process after a fault, and in a new round after
a pod loss) builds the model afresh on its own process group, then asks for its state in this order:

* **peer snapshots** (:class:`stalwart.restart.PeerSnapshots`): after every ``--snapshot-every`` steps each
  rank's shard of the model and of Adam's state is copied to a buddy rank on another pod, in the background.
  A surviving rank restores its own shard from its memory (rolling back the step in flight); a spare taking a
  lost rank's place receives that rank's shard from its buddy. At most the steps since the last snapshot are
  computed again;
* **checkpoint**: when no snapshot covers every shard (the job's start; a rank and its buddy both lost; the
  world size changed), every rank loads its shard of the newest complete checkpoint, which the ranks write
  every ``--checkpoint-every`` steps (``step-N/shard-R.pt``, tensors only, loaded with ``weights_only``; rank 0
  names the step in ``latest`` once every shard is written).

Two ways to run it, as :mod:`stalwart.examples.train`: under ``stalwart agent`` (the operator's pods), or as a
plain torchrun rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; a rank's pod is its
``GROUP_RANK``). Output: one JSON object per line (``start``, ``resume`` with where the state came from, ``step``,
``done`` with ``params_sha256``: the digest of the whole model's parameters, gathered, the same on every rank).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stalwart
from stalwart.restart import CallWrapper, PeerSnapshots

log = logging.getLogger("stalwart.examples.train_fsdp")

IN_FEATURES = 16
OUT_FEATURES = 8
LATEST = "latest"

#: A drill: the rank ``$STALWART_EXAMPLE_HANG_RANK`` hangs after step ``$STALWART_EXAMPLE_HANG_AT_STEP`` inside
#: native code that no interrupt frees (as a gloo transfer cut off in flight holds a rank), once per job: it
#: first creates ``$STALWART_EXAMPLE_HANG_MARKER``, and a process that finds the file there does not hang.
HANG_AT_STEP_ENV = "STALWART_EXAMPLE_HANG_AT_STEP"
HANG_RANK_ENV = "STALWART_EXAMPLE_HANG_RANK"
HANG_MARKER_ENV = "STALWART_EXAMPLE_HANG_MARKER"


@dataclass(frozen=True)
class Hang:
    step: int
    rank: int
    marker: Path


@dataclass(frozen=True)
class Options:
    steps: int
    batch_size: int
    lr: float
    seed: int
    hidden: int
    layers: int
    checkpoint_dir: Path
    checkpoint_every: int
    snapshot_every: int
    log_every: int
    step_delay: float
    hang: Hang | None = None


def parse_options(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> Options:
    """Options from the command line; a bad value raises ValueError naming it."""
    env = dict(os.environ) if env is None else env
    p = argparse.ArgumentParser(prog="python -m stalwart.examples.train_fsdp", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64, help="width of the hidden layers (default 64)")
    p.add_argument("--layers", type=int, default=2, help="hidden layers, each sharded on its own (default 2)")
    p.add_argument("--checkpoint-dir", default=env.get("STALWART_CHECKPOINT_DIR"),
                   help="where the ranks keep their checkpoint shards (default $STALWART_CHECKPOINT_DIR, else a "
                        "directory per job under the temporary directory)")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--snapshot-every", type=int, default=1,
                   help="steps between peer snapshots (default 1: a lost pod costs at most the step in flight; "
                        "0: none, the state comes from the checkpoint)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (default 0)")
    a = p.parse_args(argv)
    if a.snapshot_every < 0:
        raise ValueError(f"--snapshot-every must be >= 0 (0: no snapshots), got {a.snapshot_every}")
    for name in ("steps", "batch_size", "hidden", "layers", "checkpoint_every", "log_every"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(a, name)}")
    if not a.lr > 0:
        raise ValueError(f"--lr must be > 0, got {a.lr}")
    if a.step_delay < 0:
        raise ValueError(f"--step-delay must be >= 0, got {a.step_delay}")
    directory = a.checkpoint_dir or str(Path(env.get("TMPDIR", "/tmp")) / "stalwart-checkpoints"
                                        / f"fsdp-{env.get('STALWART_JOB_UID', 'local')}")
    return Options(a.steps, a.batch_size, a.lr, a.seed, a.hidden, a.layers, Path(directory), a.checkpoint_every,
                   a.snapshot_every, a.log_every, a.step_delay, _hang(env))


def _hang(env: dict[str, str]) -> Hang | None:
    if not env.get(HANG_AT_STEP_ENV):
        return None
    values = {}
    for name, default in ((HANG_AT_STEP_ENV, None), (HANG_RANK_ENV, "1")):
        raw = env.get(name) or default
        try:
            values[name] = int(raw or "")
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if not env.get(HANG_MARKER_ENV):
        raise ValueError(f"{HANG_MARKER_ENV} must name the file that makes the hang happen once, "
                         f"as {HANG_AT_STEP_ENV} is set")
    return Hang(values[HANG_AT_STEP_ENV], values[HANG_RANK_ENV], Path(env[HANG_MARKER_ENV]))


def maybe_hang(hang: Hang | None, rank: int, step: int) -> None:
    """The drill's hang (see :data:`HANG_AT_STEP_ENV`): blocks this thread for good, where the interrupt that
    stalwart delivers cannot end it, so that the rank is freed only by its agent killing the process."""
    if hang is None or (hang.step, hang.rank) != (step, rank):
        return
    try:
        hang.marker.touch(exist_ok=False)
    except FileExistsError:
        return
    emit("hang", rank=rank, step=step)
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # a pthread_mutex_t (40 bytes on x86-64 Linux)
    libc.pthread_mutex_init(mutex, None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # its owner locking a normal mutex again: blocked for good, deaf to signals


def build(opts: Options) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, the same on every rank (seeded), sharded over this iteration's group, and its Adam."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(opts.seed)
    widths = [IN_FEATURES, *[opts.hidden] * opts.layers, OUT_FEATURES]
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=opts.lr)


def batch(seed: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's batch at one step: a pure function of its arguments, so a step computed again sees it again."""
    true_map = torch.randn(IN_FEATURES, OUT_FEATURES, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(size, IN_FEATURES, generator=torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank))
    return x, torch.tanh(x @ true_map)


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


def _shard_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": _local(v).detach().clone() for k, v in model.state_dict().items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer.{i}.{key}"] = _local(value).detach().clone()
    return out


def save_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Every rank writes its shard; rank 0 names the step in ``latest`` once all are written (after a barrier),
    so a reader never takes a step of which a shard is missing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = directory / f"step-{step}-of-{world}"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".shard-{rank}.tmp"
    torch.save(_shard_state(model, optimizer), tmp)
    os.replace(tmp, folder / f"shard-{rank}.pt")
    dist.barrier()
    if rank == 0:
        tmp = directory / f".{LATEST}.tmp"
        tmp.write_text(folder.name)
        os.replace(tmp, directory / LATEST)


def load_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load this rank's shard of the newest complete checkpoint; 0 when there is none (or it is of another
    world size, which this example cannot reshard)."""
    from stalwart.restart.snapshots import ensure_optimizer_state

    rank, world = dist.get_rank(), dist.get_world_size()
    latest = directory / LATEST
    if not latest.exists():
        return 0
    name = latest.read_text().strip()
    if not name.endswith(f"-of-{world}"):
        log.warning("rank %d: the checkpoint %s is of another world size than %d: starting afresh", rank, name, world)
        return 0
    data: dict[str, torch.Tensor] = torch.load(directory / name / f"shard-{rank}.pt", weights_only=True)
    ensure_optimizer_state(model, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    with torch.no_grad():
        for k, v in model.state_dict().items():
            _local(v).copy_(data[f"model.{k}"])
        for i, p in enumerate(params):
            for key, value in optimizer.state[p].items():
                if isinstance(value, torch.Tensor):
                    _local(value).copy_(data[f"optimizer.{i}.{key}"])
    return int(name.removeprefix("step-").split("-of-")[0])


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "time": round(time.time(), 3), **fields}), flush=True)


def params_digest(model: nn.Module) -> str:
    """The digest of the whole model's parameters (each gathered from its shards: a collective)."""
    digest = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _pod() -> str:
    return os.environ.get("STALWART_NODE_ID") or f"group-{os.environ.get('GROUP_RANK', '0')}"


_started = False


@stalwart.restartable()
def train(opts: Options, call_wrapper: CallWrapper | None = None) -> float:
    """Train to ``opts.steps``; safe to call again in the same process (in-process restart, a new round)."""
    global _started
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(opts)
    snapshots = PeerSnapshots(model, optimizer, every=opts.snapshot_every, pod=_pod()) if opts.snapshot_every \
        else None
    restored = snapshots.restore() if snapshots is not None else None
    if restored is not None:
        step, source = restored, "peers"
    else:
        step = load_checkpoint(opts.checkpoint_dir, model, optimizer)
        source = "checkpoint" if step else "fresh"
    if not _started:
        emit("start", rank=rank, world_size=world, step=step)
        _started = True
    emit("resume", rank=rank, world_size=world, step=step, source=source,
         reason=snapshots.fallback_reason if snapshots is not None else None,
         iteration=call_wrapper.iteration if call_wrapper is not None else 0)
    loss = torch.tensor(float("nan"))
    while step < opts.steps:
        x, y = batch(opts.seed, step, rank, opts.batch_size)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        # The update and the count together, or neither: a restart between them would apply this step twice.
        with call_wrapper.atomic() if call_wrapper is not None else contextlib.nullcontext():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        if snapshots is not None:
            snapshots.commit(step)
        if call_wrapper is not None:
            call_wrapper.ping(step)
        if step % opts.checkpoint_every == 0 or step == opts.steps:
            save_checkpoint(opts.checkpoint_dir, model, optimizer, step)
        if step % opts.log_every == 0 or step == opts.steps:
            emit("step", rank=rank, step=step, loss=round(float(loss.detach()), 6))
        maybe_hang(opts.hang, rank, step)
        if opts.step_delay:
            time.sleep(opts.step_delay)
    if snapshots is not None:
        snapshots.close()
    emit("done", rank=rank, world_size=world, step=step, loss=round(float(loss.detach()), 6),
         params_sha256=params_digest(model), snapshot_bytes=snapshots.held_bytes() if snapshots is not None else 0)
    return float(loss.detach())


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = parse_options(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("STALWART_JOB"):
        train(opts)
        return 0
    dist.init_process_group("gloo")
    try:
        train.fn(opts)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
