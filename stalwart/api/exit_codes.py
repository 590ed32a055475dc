"""Exit codes of rank processes and of the agent, and what the operator does about each.

One table, read by three parties: the in-process restart wrapper (which exits with these codes when it
gives up), the agent (which decides whether to respawn a rank process locally) and the operator (which maps
the agent's exit code, the worker container's exit code, onto pod replacement or job failure).

Codes 64-78 are avoided (``sysexits.h``), as are codes above 125 (shells and signals use them);
a rank killed by a signal is reported by the agent as ``128 + signal`` like a shell would.
"""

from __future__ import annotations

import enum

__all__ = ["Disposition", "ExitCode", "disposition"]


class Disposition(enum.StrEnum):
    """What should happen after a process exits with a code."""

    SUCCEEDED = "Succeeded"
    #: The job cannot succeed by retrying: the operator marks it ``Failed``.
    JOB_FAILURE = "JobFailure"
    #: This pod (its node, its GPU) is unfit or its round is over: the operator replaces the pod.
    POD_REPLACEMENT = "PodReplacement"
    #: The agent respawns the rank process locally; the operator sees nothing.
    LOCAL_RESPAWN = "LocalRespawn"


class ExitCode(enum.IntEnum):
    """Documented exit codes. Anything not listed (``1``, an uncaught exception) is :data:`FAILED`."""

    #: The training function returned on every rank.
    OK = 0
    #: The script failed outside the wrapper's control (uncaught error, bad arguments).
    FAILED = 1
    #: The wrapper used up ``max_restarts`` in-process restarts. Job failure: the fault repeats.
    RESTARTS_EXHAUSTED = 90
    #: The user function raised :class:`stalwart.NonRetryable`. Job failure.
    NON_RETRYABLE = 91
    #: The health check of this rank failed (e.g. a CUDA error). Pod replacement: the node is suspect.
    UNHEALTHY = 92
    #: Fewer ranks than the minimum world size are left. Pod replacement: the operator brings new pods
    #: and the next rendezvous round starts with them.
    WORLD_TOO_SMALL = 93
    #: A round-bound write was refused because a newer rendezvous round exists. Local: the agent rejoins.
    STALE_EPOCH = 94
    #: etcd stayed unreachable for longer than the coordination timeout. Pod replacement.
    COORDINATION_LOST = 95
    #: The agent killed a rank process that made no progress within the hard timeout. Local respawn.
    HARD_TIMEOUT = 96
    #: The rank processes were told to stop (SIGTERM forwarded by the agent). Pod replacement if the pod
    #: did not ask for it itself.
    TERMINATED = 97
    #: The rank's main thread stayed blocked in native code after its interrupt (gloo does not fail a transfer
    #: already in flight when its connection is shut down): the process wrote out the snapshots it held and
    #: ended itself rather than wait for its hard timeout. Local respawn.
    ABANDONED = 98
    #: The agent found its pod fenced by the operator (counted lost, and replaced): a zombie back from a
    #: partition. It stops its rank processes and exits; the job already went on without it.
    FENCED = 99
    #: The ``prepare`` hook of ``@stalwart.restartable(prepare=...)`` raised in a parked process (a warm spare's,
    #: or a pod's standby) before any round took it: that process ends, the running ranks go on. Also a hook
    #: that did not return within ``prepare_timeout``, wherever it ran. Job failure if it reaches the
    #: supervision of a round (a rank whose hook hung; the agent supervises no parked process).
    PREPARE_FAILED = 100


_DISPOSITIONS: dict[int, Disposition] = {
    ExitCode.OK: Disposition.SUCCEEDED,
    ExitCode.RESTARTS_EXHAUSTED: Disposition.JOB_FAILURE,
    ExitCode.NON_RETRYABLE: Disposition.JOB_FAILURE,
    ExitCode.UNHEALTHY: Disposition.POD_REPLACEMENT,
    ExitCode.WORLD_TOO_SMALL: Disposition.POD_REPLACEMENT,
    ExitCode.STALE_EPOCH: Disposition.LOCAL_RESPAWN,
    ExitCode.COORDINATION_LOST: Disposition.POD_REPLACEMENT,
    ExitCode.HARD_TIMEOUT: Disposition.LOCAL_RESPAWN,
    ExitCode.TERMINATED: Disposition.POD_REPLACEMENT,
    ExitCode.ABANDONED: Disposition.LOCAL_RESPAWN,
    ExitCode.FENCED: Disposition.POD_REPLACEMENT,
    ExitCode.PREPARE_FAILED: Disposition.JOB_FAILURE,
}


def disposition(code: int) -> Disposition:
    """What to do after exit code ``code``. Negative codes (killed by signal ``-code``, as ``subprocess``
    reports them) and ``128+N`` codes mean the process died: respawn it locally. Any other unknown code is an
    ordinary script failure, which the agent retries with process restarts and then reports as
    :data:`Disposition.JOB_FAILURE`."""
    if code in _DISPOSITIONS:
        return _DISPOSITIONS[code]
    if code < 0 or 128 < code < 160:
        return Disposition.LOCAL_RESPAWN
    return Disposition.JOB_FAILURE
