"""How often an agent writes its progress record in a round of a given size, which the agents (writing) and the
operator (judging an agent silent) both follow."""

from __future__ import annotations

__all__ = ["MAX_PACED_INTERVAL", "PROGRESS_WRITES_PER_SECOND", "progress_interval"]

#: The progress writes a second a job's agents send etcd together, at most, beyond a job of this many pods: each
#: is a proposal (about a millisecond on a 3-member etcd with TLS), and at one a second per pod a job of 2,048
#: pods spent two seconds of etcd's time every second on them, before any rendezvous or barrier could run.
PROGRESS_WRITES_PER_SECOND = 256

#: The longest a paced agent waits between writes. The operator takes a pod whose agent holds no lease and has
#: not rewritten its record for 15 s for lost (``AGENT_SILENT_SECONDS``), and a write that fails waits up to
#: 10 s of back-off: pacing never brings a live agent near that line.
MAX_PACED_INTERVAL = 5.0


def progress_interval(nodes: int, *, least: float, soft_timeout: float | None) -> float:
    """Seconds between one agent's progress writes in a round of ``nodes`` pods (members and spares).

    ``least`` (the agent's setting) while the job's writes stay within :data:`PROGRESS_WRITES_PER_SECOND`;
    ``nodes`` over that rate beyond, but never more than :data:`MAX_PACED_INTERVAL` nor a third of the job's
    ``soft_timeout`` (the operator judges a rank stalled by the progress its agent last reported), nor less
    than ``least``. A forced write (a rank's exit, a state change) does not wait for it."""
    if nodes < 1:
        raise ValueError(f"nodes: expected at least 1 pod, got {nodes}")
    if least < 0:
        raise ValueError(f"least: expected seconds >= 0, got {least}")
    paced = min(nodes / PROGRESS_WRITES_PER_SECOND, MAX_PACED_INTERVAL)
    if soft_timeout is not None and soft_timeout > 0:
        paced = min(paced, soft_timeout / 3)
    return max(least, paced)
