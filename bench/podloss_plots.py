"""The pictures of bench/podloss.py: each rank's step against the time around the fault, and the phases of every
case's recovery."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster_job import Events

from stalwart.api.recovery import PHASES

__all__ = ["plot", "plot_phases"]


def plot(path: Path, runs: dict[str, tuple[float, Events]], fault: str, params: int) -> None:
    """One panel per implementation on one time axis. The ranks take the same steps at nearly the same
    times, so rank 0 is drawn as rings under rank 1's dots (else one hides the other); the legend sits below
    the panels, off the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = (-5.0, 20.0)
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.9), sharey=True, sharex=True, squeeze=False)
    styles = {0: {"marker": "o", "ms": 5, "mfc": "none", "color": "tab:blue"},
              1: {"marker": ".", "ms": 3, "color": "tab:orange"}}
    for ax, (impl, (t_fault, events)) in zip(axes[0], runs.items(), strict=True):
        for rank, style in styles.items():
            pts = sorted((e["time"] - t_fault, e["step"]) for e in events if e["event"] == "step"
                         and e["rank"] == rank and window[0] <= e["time"] - t_fault <= window[1])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="none", label=f"rank {rank}", **style)
        if not any(e["event"] == "step" and e["time"] > t_fault for e in events):
            ax.text(0.5, 0.5, "no step after the fault", transform=ax.transAxes, ha="center", color="tab:red")
        ax.axvline(0, color="red", lw=1, label="fault")
        ax.set_title(impl)
        ax.set_xlim(*window)
        ax.set_xlabel("seconds from the fault")
    axes[0][0].set_ylabel("step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"pod loss ({fault}), {params:,} parameters: each rank's steps around the fault")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def plot_phases(path: Path, rows: list[dict[str, Any]]) -> None:
    """One stacked bar per case (size, workers, fault, implementation): its phases' seconds, fault to first full
    step, each phase a colour; the GB/s of the copy beside the bar; the legend below. A case run more than once
    in ``rows`` is a bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases: dict[tuple[int, int, str, str, int], dict[str, float]] = {}
    rates: dict[tuple[int, int, str, str, int], float] = {}
    runs: dict[tuple[int, int, str, str], int] = {}  # the case's runs in these rows so far
    for r in rows:
        if r.get("impl") == "torchft":  # not a pod loss: its rows are in the table beside
            continue
        case = (int(r["params"]), int(r.get("workers", 2)), str(r["fault"]), str(r["impl"]))
        if r.get("metric") == "phase_seconds" and r.get("phase") == PHASES[0]:
            runs[case] = runs.get(case, 0) + 1  # a case's rows start with its first phase: another run of it
        key = (*case, runs.get(case, 1))
        if r.get("metric") == "phase_seconds" and r.get("value") is not None:
            cases.setdefault(key, {})[str(r["phase"])] = float(r["value"])
        elif r.get("metric") == "copy_gbps" and r.get("value") is not None:
            rates[key] = float(r["value"])
    order = sorted(cases, key=lambda k: (k[0], k[1], k[2], k[3] != "stalwart", k[4]))
    if not order:
        return
    colours = dict(zip(PHASES, ("tab:red", "tab:orange", "tab:olive", "tab:purple", "tab:blue", "tab:green"),
                       strict=True))
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(order) + 1.6))
    for y, key in enumerate(order):
        left = 0.0
        for ph in PHASES:
            width = cases[key].get(ph, 0.0)
            ax.barh(y, width, left=left, color=colours[ph], label=ph.replace("_", " ") if y == 0 else None)
            left += width
        note = f" {left:.2f} s" + (f", copy {rates[key]:.2f} GB/s" if key in rates else "")
        ax.text(left, y, note, va="center", fontsize=7)
    labels = [f"{p / 1e6:g} M, {w}+1, {f}, {'warm spares' if i == 'stalwart' else 'process restart'}"
              + (f", run {n}" if runs.get((p, w, f, i), 1) > 1 else "") for p, w, f, i, n in order]
    ax.set_yticks(range(len(order)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the fault to the first step at full world size")
    ax.set_xlim(0, max(sum(c.values()) for c in cases.values()) * 1.3)
    # Below the axes, in one row: inside them it covered the last bar's label.
    handles, names = ax.get_legend_handles_labels()
    height = fig.get_figheight()
    fig.legend(handles, names, loc="lower center", ncol=len(PHASES), fontsize=7, frameon=False)
    ax.set_title("pod loss: where the recovery's time goes (bench/podloss.py)")
    fig.tight_layout(rect=(0.0, 0.3 / height, 1.0, 1.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
