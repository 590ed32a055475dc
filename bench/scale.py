"""Scale benchmark: thousands of simulated agents and ranks on stalwart's real protocols, one model etcd.

What runs (see docs/scale.md): the real rendezvous driver and pure protocol, one driver per simulated pod,
and the real restart ``Coordinator`` per simulated rank, against an in-memory etcd model
(``bench/scalesim/memetcd.py``, checked against the real server by ``tests/bench``) whose time is a cost
model measured first on real etcd servers of this machine (``bench/scalesim/calibrate.py``: ``--calibrations``
``plain-1`` one member without fsync, TLS or login; ``fsync-1``; ``tls-1`` fsync, TLS with client certificates
and authentication; ``tls-3`` the same in a raft group of three; each a ``calibration`` row, the one the
simulation uses ``published``, by default ``tls-3``; ``--quick`` calibrates on ``plain-1`` only). Simulated
seconds, exact etcd write and watch-event counts. One process, one thread; its CPU time is reported.

Per N (``--nodes``): ``rendezvous_seconds`` (every node holds round 1), ``writes_per_node``,
``peak_requests_per_second``, ``watch_events`` and ``manifest_bytes``; ``rerendezvous_seconds`` (one member's
lease ends; every survivor holds the next round); ``restart_barrier_seconds`` (N ranks; one reports a fault;
every rank released into the next iteration), ``writes_per_rank_per_restart`` (etcd proposals; with
``keys_written_per_rank``) and ``restart_requests_per_rank``, with the pods' barrier relays (``stalwart``, 8
ranks a pod) and without (``stalwart-per-rank``), and with the ranks' aborts spread over 50 ms
(``stalwart-aborts-50ms-apart``); ``completion_seconds`` (every
rank's function returns at once; every rank knows the iteration ended); ``operator_read_bytes``
(one read of the job's rendezvous prefix). Where round 1 cannot be sealed (past about 12,000 nodes the
manifest is over ``MAX_MANIFEST_BYTES``, the most its parts may hold in one transaction) the row says so, and
``impl: "stalwart-cap-raised"`` shows the same run with the record cap at etcd's request limit.
The anchor, ``impl: "anchor-cas"``: one shared record updated by compare-and-swap (torch's
DynamicRendezvousHandler's shape), up to ``--anchor-max`` nodes. ``validate-real-etcd`` rows: the restart
barrier of ``--validate-ranks`` ranks (a real ``Coordinator`` each, the pods' relays as the simulator models them)
and the first rendezvous of ``--validate-nodes`` nodes (real drivers) on a real etcd of the kind
``--validate-on`` (by default ``tls-3``: three members, fsync, TLS, authentication as the job's own user), in
``--validate-processes`` worker processes (:mod:`.scalesim.real_barrier`, :mod:`.scalesim.real_rendezvous`);
``validate-sim`` rows: the simulator with the same layout, background and the calibration of that etcd, and
``real_over_sim`` on the real row. An etcd it cannot reach or that refuses its TLS settings prints no row.

Charged in every ``stalwart`` row: the project's code its measured CPU (``cpu_seconds`` per phase) and, for the
restart and the re-rendezvous, the running job's background requests (``background_requests_per_second``;
a load that takes the whole etcd is not simulated and the row says ``saturated``). ``stalwart-no-background``
and ``stalwart-uncharged`` give the barrier without the load, and without either (see :mod:`.scalesim.sim`).

Also a goodput curve (``--plot``) from this run's figures, ``bench/restart.py``'s measured in-process
and process restart times (run here unless ``--restart-results`` names its saved output) and, for a lost node,
a warm spare's pod-loss recovery from a saved ``bench/podloss.py`` run (``--podloss-results``).
Usage: ``python bench/scale.py [--nodes 1000 4000 10000] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scalesim.anchor import CasRun  # noqa: E402
from bench.scalesim.calibrate import CALIBRATIONS, CalibrationError, calibrate, started  # noqa: E402
from bench.scalesim.goodput import Assumptions, Design, designs, goodput, interpolate, plot  # noqa: E402
from bench.scalesim.real_etcd import ValidationError  # noqa: E402
from bench.scalesim.rendezvous import PREFIX, RendezvousRun  # noqa: E402
from bench.scalesim.restart import RestartRun  # noqa: E402
from bench.scalesim.sim import Background, Costs  # noqa: E402
from bench.scalesim.validate import Sizes, barrier_rows, rendezvous_rows, without_client  # noqa: E402
from stalwart.api.base import MAX_RECORD_BYTES  # noqa: E402
from stalwart.api.manifest import MAX_MANIFEST_BYTES  # noqa: E402

#: The real validation's default sizes: the largest this 2-core machine holds in a few minutes (docs/scale.md).
VALIDATE_RANKS = 4000
VALIDATE_NODES = 2000
ETCD_REQUEST_LIMIT = 1572864  # etcd's default --max-request-bytes
LIMIT = 36000.0  # simulated seconds before a run is called capped
SATURATED = 0.98  # a background load that takes this share of etcd's time is not simulated (its queue grows)


def emit(impl: str, nodes: int, metric: str, value: float | None, **extra: Any) -> None:
    row = {"bench": "scale", "impl": impl, "nodes": nodes, "metric": metric,
           "value": None if value is None else round(value, 6)}
    row.update({k: v for k, v in extra.items() if v is not None})
    print(json.dumps(row), flush=True)


def rounded(costs: Costs) -> dict[str, Any]:
    """The cost model's fields for a row (``--costs`` takes them back)."""
    return {k: [[c, round(s, 9)] for c, s in v] if k.endswith("_batched") else round(v, 9)
            for k, v in costs.as_dict().items()}


def cpu_rows(impl: str, n: int, what: str, phases: dict[str, float]) -> None:
    """The CPU seconds the project's code took in ``what``, per phase, summed over the simulated processes
    (each would have its own core; the ``sealer`` phase is one process's, serial on the critical path)."""
    for phase, seconds in sorted(phases.items()):
        emit(impl, n, "cpu_seconds", seconds, what=what, phase=phase)


def validation(sizes: Sizes, on: str, costs: Costs, calibration: str) -> list[dict[str, Any]]:
    """The real barrier and the real first rendezvous on a fresh etcd of the kind ``on`` (by default the 3-member
    TLS etcd with authentication), each beside the simulator configured alike; the rows, not printed yet."""
    kind = CALIBRATIONS[on]
    rows: list[dict[str, Any]] = []
    with started(kind) as target:
        if sizes.ranks:
            rows += barrier_rows(target, kind, costs, calibration=calibration, ranks=sizes.ranks,
                                 processes=sizes.processes)
        if sizes.nodes:
            rows += rendezvous_rows(target, kind, costs, calibration=calibration, nodes=sizes.nodes,
                                    processes=sizes.processes)
    return rows


def scale_rows(n: int, costs: Costs, anchor_max: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    # The running job's steady requests (the first rendezvous has none: nothing runs yet): for the restart rows n
    # ranks, 8 a pod; for the re-rendezvous n nodes of 8 ranks.
    load, nodes_load = Background(ranks=n, nodes=-(-n // 8)), Background(ranks=8 * n, nodes=n)
    for what, bg in (("restart", load), ("rerendezvous", nodes_load)):
        emit("stalwart", n, "background_requests_per_second", sum(bg.rates().values()), what=what,
             **{k: round(v, 1) for k, v in bg.rates().items()},
             server_busy_fraction=round(bg.busy_per_second(costs), 4), ranks=bg.ranks, pods=bg.nodes)
    t0 = time.process_time()
    # A load that needs the whole server (or more) leaves nothing for the protocol: not simulated, said so.
    rdzv_saturated = nodes_load.busy_per_second(costs) >= SATURATED
    run = RendezvousRun(n, costs, background=None if rdzv_saturated else nodes_load)
    first = run.first_round(LIMIT)
    impl = "stalwart"
    emit(impl, n, "rendezvous_seconds", first["seconds"], sealed=first["sealed"], error=first["error"],
         capped=(first["sealed"] and first["seconds"] is None) or None, goal="< 15 s at 10,000")
    emit(impl, n, "writes_per_node", first["writes"] / (n + 1), goal="<= 3", note="the spare counts as a node")
    emit(impl, n, "peak_requests_per_second", first["peak_requests_per_second"])
    emit(impl, n, "watch_events", first["watch_events"], bytes=first["watch_bytes"])
    if not first["sealed"]:
        impl = "stalwart-cap-raised"
        run = RendezvousRun(n, costs, record_limit=ETCD_REQUEST_LIMIT)
        first = run.first_round(LIMIT)
        emit(impl, n, "rendezvous_seconds", first["seconds"], sealed=first["sealed"], error=first["error"])
        emit(impl, n, "writes_per_node", first["writes"] / (n + 1))
        emit(impl, n, "watch_events", first["watch_events"], bytes=first["watch_bytes"])
    emit(impl, n, "manifest_bytes", first["manifest_bytes"], limit=MAX_MANIFEST_BYTES, record_cap=MAX_RECORD_BYTES,
         note="header and parts" if first["manifest_bytes"] > MAX_RECORD_BYTES else None)
    kvs, _ = run.sim.mem.get_prefix(PREFIX)
    size = sum(len(kv.key) + len(kv.value) for kv in kvs)
    emit(impl, n, "operator_read_bytes", size, keys=len(kvs),
         seconds=round(costs.read + costs.read_key * len(kvs) + costs.read_byte * size, 6))
    if first["sealed"] and first["seconds"] is not None:
        again = run.lose_one(LIMIT)
        if rdzv_saturated:
            emit(impl, n, "rerendezvous_seconds", None, saturated=round(nodes_load.busy_per_second(costs), 3),
                 note="the running job's background alone needs this many seconds of etcd's time per second")
            impl = f"{impl}-no-background"
        out["rerendezvous"] = again["seconds"]
        emit(impl, n, "rerendezvous_seconds", again["seconds"], seal_seconds=again["seal_seconds"],
             writes=again["writes"], background=not rdzv_saturated, goal="< 2 s at 10,000")
    cpu_rows(impl, n, "rendezvous", run.sim.cpu_seconds)
    emit("stalwart", n, "sim_cpu_seconds", time.process_time() - t0, what="rendezvous")
    # "stalwart": the pods' agents relay their ranks' barrier requests (8 ranks a pod), as the agent does;
    # "stalwart-per-rank": every rank asks etcd itself (a rank without an agent; the protocol before the relay).
    # "stalwart-aborts-50ms-apart": with the relays, the ranks' aborts ending up to 50 ms apart (a loaded machine),
    # so that a pod's requests come further apart than the relay's linger.
    phases_printed = False
    # Charged, as every row above: the project's CPU and the running job's background requests. Beside them,
    # "stalwart-no-background" (the CPU only) and "stalwart-uncharged" (neither: the model as published before).
    # "stalwart-rank-leases": the ranks' liveness on a lease per rank (as before the agents lent their pod's: a
    # rank without an agent still holds its own); "stalwart-pod-leases-apart": on a lease per pod beside the node's
    # (as before the agents lent the node's own: a job whose heartbeat TTL differs from its lease TTL).
    # "stalwart-client-uncharged": all of it but the etcd client's CPU (as the model was before it charged it).
    # What-ifs, not the code (``RestartRun.pod_fanout``): every watch of a pod's ranks one watch of its agent and
    # a pod's arrivals one record; "-no-background": and none of the job's steady requests.
    rank_leases = replace(load, ranks_per_lease=1)
    leases_apart = replace(load, ranks_on_node_lease=False)
    bare = without_client(costs)
    for impl, relay, spread, cpu, bg, fanout in (
            ("stalwart", True, 0.0, True, load, False),
            *((("stalwart-client-uncharged", True, 0.0, True, load, False),) if bare else ()),
            ("stalwart-rank-leases", True, 0.0, True, rank_leases, False),
            ("stalwart-pod-leases-apart", True, 0.0, True, leases_apart, False),
            ("stalwart-per-rank", False, 0.0, True, load, False),
            ("stalwart-aborts-50ms-apart", True, 0.05, True, load, False),
            ("stalwart-no-background", True, 0.0, True, None, False),
            ("stalwart-uncharged", True, 0.0, False, None, False),
            ("what-if-pod-fanout", True, 0.0, True, load, True),
            ("what-if-pod-fanout-no-background", True, 0.0, True, None, True)):
        row_costs = bare if bare is not None and impl == "stalwart-client-uncharged" else costs
        t0 = time.process_time()
        if bg is not None and bg.busy_per_second(costs) >= SATURATED:
            if impl == "stalwart":
                out.setdefault("barrier", None)
            emit(impl, n, "restart_barrier_seconds", None, ranks=n, saturated=round(bg.busy_per_second(costs), 3),
                 note="the running job's background alone needs this many seconds of etcd's time per second")
            continue
        restart = RestartRun(n, row_costs, relay=relay, abort_spread=spread, cpu=cpu, background=bg,
                             pod_fanout=fanout).restart(LIMIT)
        if impl == "stalwart":
            out["barrier"] = restart["seconds"]
        if cpu and not phases_printed:  # once, from the first charged run
            phases_printed = True
            cpu_rows(impl, n, "restart", restart["cpu_seconds"])
        emit(impl, n, "restart_barrier_seconds", restart["seconds"], ranks=n, released=restart["released"],
             seals=restart["seals"], seal_seconds=restart["seal_seconds"], cpu_charged=cpu, background=bg is not None,
             background_busy=None if bg is None else round(bg.busy_per_second(costs), 4),
             watch_events=restart["watch_events"], goal="< 0.5 s at 16,384")
        if bg is not load or fanout or row_costs is not costs:  # the same writes as the run of the job's own background
            continue
        emit(impl, n, "writes_per_rank_per_restart", restart["writes"] / n, goal="<= 2",
             keys_written_per_rank=restart["keys_written"] / n,
             relay_transactions=restart["relay_transactions"] if relay else None)
        emit(impl, n, "restart_requests_per_rank", restart["requests"] / n, requests=restart["requests"])
        emit(impl, n, "restart_watch_events", restart["watch_events"], bytes=restart["watch_bytes"],
             reads=restart["reads"])
        emit(impl, n, "sim_cpu_seconds", time.process_time() - t0, what="restart")
    end = RestartRun(n, costs).complete(LIMIT)
    emit("stalwart", n, "completion_seconds", end["seconds"], ranks=n, ended=end["ended"],
         writes=end["writes"], watch_events=end["watch_events"], limit="the 60 s completion timeout")
    if n <= anchor_max:
        res = CasRun(n, costs, grow=False).run(LIMIT)
        emit("anchor-cas", n, "rendezvous_seconds", res["seconds"])
        emit("anchor-cas", n, "writes_per_node", res["writes"] / n, refused=res["refused"])
    return out


def restart_times(path: str | None) -> tuple[float, float, str]:
    """Median recovery seconds of stalwart's in-process restart and of torchrun's process restart."""
    if path:
        text, source = Path(path).read_text(), path
    else:
        text = subprocess.run([sys.executable, str(ROOT / "bench" / "restart.py"), "--ranks", "2", "--runs", "3",
                               "--what", "restart"], capture_output=True, text=True, timeout=900, check=True).stdout
        source = "bench/restart.py --ranks 2 --runs 3 --what restart (this run)"
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    seconds = {r["impl"]: r["value"] for r in rows if r.get("metric") == "seconds"}
    return seconds["stalwart"], seconds["torchrun"], source


def pod_loss_time(path: str) -> tuple[float, str]:
    """The median seconds of stalwart's warm-spare recovery from a force-deleted pod in a saved run of
    bench/podloss.py (from the fault to the first full step, less a step), and where it came from."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith("{")]
    seconds = [r["value"] for r in rows if r.get("bench") == "podloss" and r.get("impl") == "stalwart"
               and r.get("metric") == "seconds" and r.get("fault") == "force-delete" and r.get("value") is not None]
    if not seconds:
        raise SystemExit(f"--podloss-results {path}: no row of bench/podloss.py with impl stalwart, fault "
                         "force-delete and a value (its 'seconds' metric)")
    params = sorted({r.get("params") for r in rows if r.get("bench") == "podloss"} - {None})
    resolved = Path(path).resolve()
    shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else Path(path).name  # no machine's paths
    return statistics.median(seconds), f"{shown} (bench/podloss.py, {'/'.join(f'{p:,}' for p in params)} parameters)"


def draw(path: str, rows: dict[int, dict[str, float | None]], inproc: float, process: float, source: str, *,
         pod_loss: tuple[float, str] | None = None) -> None:
    a = Assumptions()
    lost, lost_source = pod_loss if pod_loss is not None else (None, None)
    emit("goodput-inputs", 0, "restart_seconds", inproc, process_restart_seconds=process, source=source,
         pod_loss_seconds=lost, pod_loss_source=lost_source)
    barrier = interpolate([(n, v) for n, r in rows.items() if (v := r.get("barrier")) is not None])
    # The re-rendezvous runs over nodes; the barrier over ranks (GPUs).
    rerdzv_pts = [(n, v) for n, r in rows.items() if (v := r.get("rerendezvous")) is not None]
    rerdzv = interpolate(rerdzv_pts) if rerdzv_pts else (lambda n: 0.0)
    ds = designs(a, inprocess_seconds=inproc, barrier_seconds=lambda nodes: barrier(nodes * a.gpus_per_node),
                 rerendezvous_seconds=rerdzv, process_restart_seconds=process, pod_loss_seconds=lost)
    goals = designs(a, inprocess_seconds=inproc, barrier_seconds=lambda n: 2.0, rerendezvous_seconds=lambda n: 2.0,
                    process_restart_seconds=process, pod_loss_seconds=lost)[0]
    ds.insert(1, Design(goals.name.replace("(", "with the 2 s goals met, a what-if (", 1), goals.rank_fault,
                        goals.node_loss))
    sizes = [1000, 2000, 4000, 8000, 16000, 32000, 64000, 100000]
    curves = {d.name: [(g, goodput(d, g, a)) for g in sizes] for d in ds}
    for d in ds:
        for g, v in curves[d.name]:
            emit("goodput", g // a.gpus_per_node, "goodput", v, design=d.name, gpus=g)
    notes = [f"Failures: {a.rate_per_gpu_hour * 1e6:.1f} per million GPU-hours (Llama 3 report: 419 in 54 days on "
             f"16,384 GPUs), {a.node_share:.0%} take a node away. Checkpoint every {a.checkpoint_interval:.0f} s "
             f"costing {a.checkpoint_seconds:.0f} s, read back in {a.checkpoint_load_seconds:.0f} s; a step "
             f"{a.step_seconds:.0f} s.",
             f"Measured: stalwart's in-process restart {inproc:.2f} s, torchrun's process restart {process:.2f} s "
             f"({source}); stalwart's restart barrier and re-rendezvous at each size from bench/scale.py's "
             "simulator (interpolated, linear past 10,000).",
             f"A lost node: stalwart's lease TTL {a.lease_ttl:.0f} s, then "
             + (f"a warm spare's recovery as measured for a lost pod, {lost:.2f} s ({lost_source}), + re-rendezvous "
                "and barrier at the size" if lost is not None else "a spare (the in-process restart's time)")
             + f"; Kubernetes "
             f"{a.pod_replacement_seconds:.0f} s (node grace 40 s + unreachable toleration 300 s + a new pod 60 s, "
             "assumed)."]
    plot(path, curves, [line for note in notes for line in textwrap.wrap(note, 170)],
         extrapolated=(ds[0].name, max(n for n, r in rows.items() if r.get("barrier") is not None)))


def replot(path: str, saved: str, pod_loss: tuple[float, str] | None) -> None:
    """Draw the goodput curve again from a saved run's output (its own pod-loss time first, else ``pod_loss``)."""
    rows: dict[int, dict[str, float | None]] = {}
    inproc = process = None
    source = saved
    for line in Path(saved).read_text().splitlines():
        r = json.loads(line)
        if r["metric"] == "restart_barrier_seconds" and r["impl"] == "stalwart":
            rows.setdefault(r["nodes"], {})["barrier"] = r["value"]
        elif r["metric"] == "rerendezvous_seconds":
            rows.setdefault(r["nodes"], {})["rerendezvous"] = r["value"]
        elif r["metric"] == "restart_seconds" and r["impl"] == "goodput-inputs":
            inproc, process, source = r["value"], r["process_restart_seconds"], r["source"]
            if r.get("pod_loss_seconds") is not None:
                pod_loss = (r["pod_loss_seconds"], r["pod_loss_source"])
    if inproc is None or process is None:
        raise SystemExit(f"{saved}: no goodput-inputs row (a run with a plot writes one)")
    draw(path, rows, inproc, process, source, pod_loss=pod_loss)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1000, 4000, 10000])
    p.add_argument("--quick", action="store_true", help="CI-sized: 50 and 200 nodes, no plot")
    p.add_argument("--costs", help="a JSON object of Costs fields: skip the calibration")
    p.add_argument("--calibrations", nargs="+", choices=sorted(CALIBRATIONS), default=None,
                   help="the etcds to calibrate on, each a row (default: all; --quick: plain-1)")
    p.add_argument("--publish", choices=sorted(CALIBRATIONS), default=None,
                   help="the calibration the simulation uses (default: tls-3 when measured, else the last)")
    p.add_argument("--validate-nodes", type=int, default=VALIDATE_NODES,
                   help="nodes of the real first rendezvous beside the simulator's (0: none)")
    p.add_argument("--validate-ranks", type=int, default=VALIDATE_RANKS,
                   help="ranks of the real restart barrier beside the simulator's (0: none)")
    p.add_argument("--validate-processes", type=int, default=2,
                   help="worker processes that hold the validation's ranks or nodes (the simulator's alike)")
    p.add_argument("--validate-on", choices=sorted(CALIBRATIONS), default="tls-3",
                   help="the kind of etcd the validation runs on (a fresh one, started as its calibration's)")
    p.add_argument("--anchor-max", type=int, default=1000)
    p.add_argument("--plot", default=str(ROOT / "docs" / "scale_goodput.png"))
    p.add_argument("--restart-results", help="saved output of bench/restart.py (else it runs here)")
    p.add_argument("--podloss-results", default=str(ROOT / "docs" / "podloss_run.jsonl"),
                   help="saved output of bench/podloss.py: its warm-spare time stands for a lost node's recovery in "
                        "the goodput plot (default: the saved run in docs/; empty: the in-process restart's time)")
    p.add_argument("--replot", metavar="FILE", help="only draw the plot again from this saved output")
    args = p.parse_args()
    if args.replot:
        replot(args.plot, args.replot, pod_loss_time(args.podloss_results) if args.podloss_results else None)
        return 0
    if args.quick:
        args.nodes, args.validate_nodes, args.validate_ranks, args.plot = [50, 200], 50, 64, ""
    names = args.calibrations or (["plain-1"] if args.quick else list(CALIBRATIONS))
    if args.publish is not None and args.publish not in names:
        raise SystemExit(f"--publish {args.publish}: not among --calibrations {' '.join(names)}")
    measured: dict[str, Costs] = {}
    try:
        if not args.costs:
            for name in names:
                with started(CALIBRATIONS[name]) as target:
                    measured[name] = calibrate(target)
        given = Costs(**json.loads(args.costs)) if args.costs else None
        publish = args.publish or ("tls-3" if "tls-3" in measured else names[-1])
        costs = given if given is not None else measured[publish]
        # The validation's model uses the calibration of its own kind of etcd when this run measured one.
        on = args.validate_on
        sized = Sizes(args.validate_ranks, args.validate_nodes, args.validate_processes)
        checked = validation(sized, on, measured.get(on, costs), on if on in measured else
                             ("given" if given is not None else publish)) if sized.ranks or sized.nodes else []
    except (CalibrationError, ValidationError) as e:  # before any row: a run that cannot measure prints none
        print(e, file=sys.stderr)
        return 2
    if given is not None:
        emit("calibration", 0, "costs", None, calibration="given", **rounded(given))
    for name, c in measured.items():
        kind = CALIBRATIONS[name]
        emit("calibration", 0, "costs", None, calibration=name, published=name == publish, members=kind.members,
             fsync=kind.fsync, tls=kind.tls, auth=kind.auth, **rounded(c))
        for concurrency, seconds in c.write_batched:  # a row per concurrency: what etcd's batching is worth
            emit("calibration", 0, "proposal_seconds", seconds, calibration=name, concurrency=int(concurrency),
                 at_16_threads=round(c.write, 9))
        for concurrency, seconds in c.read_batched:
            emit("calibration", 0, "read_seconds", seconds, calibration=name, concurrency=int(concurrency),
                 one_at_a_time_beyond_the_round_trip=round(c.read, 9))
    for row in checked:
        emit(row.pop("impl"), row.pop("nodes"), row.pop("metric"), row.pop("value"), **row)
    rows = {n: scale_rows(n, costs, args.anchor_max) for n in args.nodes}
    if args.plot:
        draw(args.plot, rows, *restart_times(args.restart_results),
             pod_loss=pod_loss_time(args.podloss_results) if args.podloss_results else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
