"""What the agent does with its rank processes when a rendezvous round ends: pure decisions, and the file
through which a running process learns of its new round (:class:`~stalwart.api.handover.Handover`).

With warm spares on (the job's ``restartPolicy.inProcess.warmSpares``), a round's end does not end the
processes of a pod that stays: the agent joins the next round and hands each process its new assignment; the
wrapper continues there in process. A spare pod's agent starts its processes *parked* at once, so that on
promotion they are running, torch and the script imported, and only need their assignment.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from stalwart.agent.supervision import ProcView
from stalwart.api import pod_env
from stalwart.api.handover import HANDOVER_FILE_ENV, PARKED_ENV, Handover

__all__ = ["NextStep", "grow_due", "handover_env", "keep_at_round_end", "next_step", "write_handover"]

NextStep = Literal["hand_over", "launch", "park", "wait"]

#: Variables of a rank's environment that change with its round (the rest stay as the process started).
_ROUND_VARS = frozenset(pod_env.TORCHRUN_VARIABLES) - {pod_env.RUN_ID}
#: Never written to a file, even a private one: the process has it from its start.
_SECRET_VARS = frozenset({pod_env.RPC_TOKEN})


def keep_at_round_end(procs: Sequence[ProcView], *, parked: bool, warm: bool) -> bool:
    """Whether the processes outlive the round that ends: warm spares are on and every process runs the
    restart wrapper (or waits parked), alive and not stopped. Pure."""
    if not warm or not procs:
        return False
    return all(p.exit_code is None and not p.stopped and (p.wrapped or parked) for p in procs)


def next_step(role: Literal["member", "spare", "waiting"], *, kept: bool, warm: bool,
              spare_ranks: bool) -> NextStep:
    """What to do in the round just joined. Pure.

    ``hand_over``: give the kept processes their new assignment; ``launch``: start processes for the round;
    ``park``: start (or keep) parked processes and wait for the round's end; ``wait``: run nothing.
    """
    if role == "member":
        return "hand_over" if kept else "launch"
    if role == "spare" and spare_ranks and not warm:
        return "launch"
    return "park" if warm else "wait"


def grow_due(*, warm: bool, group_rank: int | None, members: int, max_nodes: int, waiting: int) -> bool:
    """Whether this node should ask for a new round to grow the world back: warm spares are on, the round
    is below ``max_nodes``, a node is waiting outside it (a replacement, its processes parked), and this
    node is the round's group rank 0 (one asker). Pure."""
    return warm and group_rank == 0 and members < max_nodes and waiting > 0


def handover_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a rank's full environment that a handover carries (no secrets). Pure."""
    return {k: v for k, v in env.items()
            if k not in _SECRET_VARS and k not in (HANDOVER_FILE_ENV, PARKED_ENV)
            and (k in _ROUND_VARS or k.startswith("STALWART_"))}


def write_handover(path: Path, handover: Handover) -> None:
    """Replace ``path`` atomically with ``handover`` (the process never reads half a file)."""
    fd, tmp = tempfile.mkstemp(prefix=".handover-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(handover.to_json_bytes())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
