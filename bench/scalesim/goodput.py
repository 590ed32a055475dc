"""A first-order goodput model: the fraction of a job's time spent making progress, per recovery design.

For a job of ``gpus`` GPUs, failures arrive at ``gpus * rate_per_gpu_hour`` per hour. Each failure costs its
recovery time plus the work lost since the state was last safe; checkpointing costs ``checkpoint_seconds``
every ``checkpoint_interval``. Goodput = 1 - checkpoint overhead - failures per second * cost per failure
(clipped at 0: past that the job makes no progress on average).

Failure kinds: a fraction ``node_share`` of failures takes a node away (a GPU, its memory, its host); the
rest leave every node up (a rank's exception, a transient network error) and an in-process restart recovers
them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Assumptions:
    #: 419 unexpected interruptions in 54 days on 16,384 H100 GPUs (Llama 3 report, section 3.3.4).
    rate_per_gpu_hour: float = 419 / (54 * 24 * 16384)
    #: Share of those taking a node away: 78% attributed to confirmed or suspected hardware (same source).
    node_share: float = 0.78
    gpus_per_node: int = 8
    checkpoint_interval: float = 1800.0
    checkpoint_seconds: float = 30.0
    #: Time to read a checkpoint back into every rank after a process restart (an assumption).
    checkpoint_load_seconds: float = 120.0
    #: The training step: what an in-process restart loses when the state stays in memory.
    step_seconds: float = 5.0
    #: stalwart's detection of a lost node: the agent's lease TTL (``leaseTTLSeconds`` default).
    lease_ttl: float = 10.0
    #: Kubernetes' own detection and replacement of a lost node's pod: node-monitor grace period (40 s)
    #: plus the default toleration of ``node.kubernetes.io/unreachable`` (300 s), then a new pod (60 s,
    #: an assumption: scheduling, container start, NCCL initialisation).
    pod_replacement_seconds: float = 40.0 + 300.0 + 60.0


@dataclass(frozen=True, slots=True)
class Design:
    """A recovery design: seconds to recover and work lost, per failure kind, at ``nodes`` nodes."""

    name: str
    rank_fault: Callable[[int], tuple[float, float]]
    node_loss: Callable[[int], tuple[float, float]]
    checkpoints: bool = True


def goodput(design: Design, gpus: int, a: Assumptions) -> float:
    nodes = max(1, gpus // a.gpus_per_node)
    per_second = gpus * a.rate_per_gpu_hour / 3600.0
    rf_recover, rf_lost = design.rank_fault(nodes)
    nl_recover, nl_lost = design.node_loss(nodes)
    cost = (1 - a.node_share) * (rf_recover + rf_lost) + a.node_share * (nl_recover + nl_lost)
    overhead = a.checkpoint_seconds / a.checkpoint_interval if design.checkpoints else 0.0
    return max(0.0, 1.0 - overhead - per_second * cost)


def designs(a: Assumptions, *, inprocess_seconds: float, barrier_seconds: Callable[[int], float],
            rerendezvous_seconds: Callable[[int], float], process_restart_seconds: float,
            pod_loss_seconds: float | None = None) -> list[Design]:
    """stalwart's design (measured inputs) and the alternatives, all under the same assumptions.

    ``pod_loss_seconds``: a lost pod's recovery measured end to end with a warm spare (bench/podloss.py: from the
    fault to the first full step, the spare's promotion and the state's copy from a peer included), which then
    stands for a lost node's recovery in place of the in-process restart; the lease TTL (a node that vanishes
    tells no one) and the re-rendezvous and the barrier at the job's size come on top of it."""
    half = a.checkpoint_interval / 2
    recover = inprocess_seconds if pod_loss_seconds is None else pod_loss_seconds
    return [
        Design("stalwart (in-process restart, spare)",
               lambda n: (inprocess_seconds + barrier_seconds(n), a.step_seconds),
               lambda n: (a.lease_ttl + rerendezvous_seconds(n) + recover + barrier_seconds(n),
                          a.step_seconds)),
        Design("process restart + checkpoint reload",
               lambda n: (process_restart_seconds + a.checkpoint_load_seconds, half),
               lambda n: (a.pod_replacement_seconds + process_restart_seconds + a.checkpoint_load_seconds,
                          half)),
        Design("pod recreation + rescheduling",
               lambda n: (a.pod_replacement_seconds - 340.0 + a.checkpoint_load_seconds, half),
               lambda n: (a.pod_replacement_seconds + a.checkpoint_load_seconds, half)),
    ]


def interpolate(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """Piecewise linear in N through measured points; linear extrapolation past the last two."""
    pts = sorted(points)

    def f(n: int) -> float:
        if len(pts) == 1:
            return pts[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if n <= x1:
                return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return max(0.0, y1 + (y1 - y0) * (n - x1) / (x1 - x0))
    return f


def plot(path: str, curves: dict[str, list[tuple[int, float]]], notes: Sequence[str],
         extrapolated: tuple[str, int] | None = None) -> None:
    """Time lost (100 % - goodput) on a log axis, where curves at 97 % and 75 % are visibly apart (on a
    0-100 % goodput axis they were flat lines at the top). ``extrapolated``: (curve, GPUs): that curve's points
    past that size (the largest simulated one) are hollow, over a shaded band: they come from the simulator's
    times extended linearly. The other curves are the model alone at every size."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 7))
    styles = [("o", "-"), ("s", ":"), ("^", "--"), ("x", "-.")]
    for (name, pts), (marker, line) in zip(curves.items(), itertools.cycle(styles), strict=False):
        xs = [p[0] for p in pts]
        lost = [max(100 * (1 - p[1]), 0.01) for p in pts]
        [drawn] = ax.plot(xs, lost, linestyle=line, label=name)
        for x, y in zip(xs, lost, strict=True):
            beyond = extrapolated is not None and name == extrapolated[0] and x > extrapolated[1]
            ax.plot([x], [y], marker=marker, color=drawn.get_color(), markersize=9 if beyond else 6,
                    markerfacecolor="white" if beyond else drawn.get_color(), zorder=4 if beyond else 2)
    if extrapolated is not None:
        right = max(p[0] for pts in curves.values() for p in pts)
        ax.axvspan(extrapolated[1], right * 1.1, color="0.92", zorder=0)
        ax.text(extrapolated[1] * 1.05, 0.98, f"hollow: {extrapolated[0]},\nextrapolated past the largest "
                f"simulated size", transform=ax.get_xaxis_transform(), va="top", fontsize=7, color="0.3")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g} %"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v:g} %" if str(round(v, 6))[0] in "25" else ""))
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("time lost: 100 % - goodput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8)
    ax.set_title("Time lost by recovery design (first-order model); lower is better")
    fig.text(0.01, 0.01, "\n".join(notes), fontsize=6, va="bottom")
    fig.subplots_adjust(bottom=0.22 + 0.025 * len(notes))
    fig.savefig(path, dpi=120)
    plt.close(fig)
