"""The simulator against a real etcd: the restart barrier and the first rendezvous, each run for real
(:mod:`.real_barrier`, :mod:`.real_rendezvous`) and simulated with the same layout, side by side.

The layout is the real run's: ``processes`` worker processes hold the ranks (whole pods of 8) or the nodes,
one etcd connection each; the simulator gets the same (``processes``: each process one simulated CPU, its
ranks' and relays' work, or its driver's, one thing at a time), the real run's background (the pods' liveness
leases, one per 8 ranks, refreshed by the real keep-alive at a third of their TTL; no node leases or progress writes,
which the real run does not make), no Unix-socket hop (the real run's relays are in the ranks' process) and
the costs of a calibration on the same kind of etcd.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from bench.scalesim.calibrate import Calibration, Target
from bench.scalesim.real_barrier import LEASE_TTL, run_barrier
from bench.scalesim.real_rendezvous import run_rendezvous
from bench.scalesim.rendezvous import RendezvousRun
from bench.scalesim.restart import RestartRun
from bench.scalesim.sim import Background, Costs

LIMIT = 600.0
#: How far apart the goal allows the real seconds and the model's at the largest size (either way).
GOAL = "real within 1.5x of the model"


@dataclass(frozen=True)
class Sizes:
    ranks: int
    nodes: int
    processes: int


def describe(kind: Calibration) -> str:
    return (f"{kind.name}: {kind.members} member{'s' if kind.members > 1 else ''}, "
            f"{'fsync' if kind.fsync else 'no fsync'}, {'TLS' if kind.tls else 'no TLS'}, "
            + ("authentication, the job's own user" if kind.auth else "no authentication"))


def without_client(costs: Costs) -> Costs | None:
    """The same costs without the etcd client's CPU (as the model was before it charged it), to print beside;
    ``None`` where there is none to take off."""
    if not (costs.client_request or costs.client_event):
        return None
    return replace(costs, client_request=0.0, client_event=0.0)


def _side_by_side(metric: str, n: int, real: dict[str, Any], sim: dict[str, Any], *, common: dict[str, Any],
                  writes: tuple[str, float, float]) -> list[dict[str, Any]]:
    ratio = real["seconds"] / sim["seconds"] if sim["seconds"] else None
    extra_real = {k: v for k, v in real.items() if k != "seconds"}
    extra_sim = {k: v for k, v in sim.items() if k != "seconds"}
    name, real_writes, sim_writes = writes
    return [
        {"impl": "validate-real-etcd", "nodes": n, "metric": metric, "value": real["seconds"], **common,
         "real_over_sim": None if ratio is None else round(ratio, 3), "goal": GOAL, **extra_real},
        {"impl": "validate-sim", "nodes": n, "metric": metric, "value": sim["seconds"], **common, **extra_sim},
        {"impl": "validate-real-etcd", "nodes": n, "metric": name, "value": real_writes, **common,
         "source": "etcd proposals"},
        {"impl": "validate-sim", "nodes": n, "metric": name, "value": sim_writes, **common},
    ]


def barrier_rows(target: Target, kind: Calibration, costs: Costs, *, calibration: str, ranks: int,
                 processes: int) -> list[dict[str, Any]]:
    real = run_barrier(target.endpoint, target.credentials, target.metrics_endpoints, ranks, processes)
    load = Background(ranks=ranks, nodes=0, rank_ttl=float(LEASE_TTL))
    run = RestartRun(ranks, costs, processes=processes, hop=0.0, background=load).restart(LIMIT)
    common = {"ranks": ranks, "processes": processes, "ranks_per_pod": 8, "etcd": describe(kind),
              "calibration": calibration}
    sim = {"seconds": run["seconds"], "seal_seconds": run["seal_seconds"], "released": run["released"],
           "relay_transactions": run["relay_transactions"],
           "background_requests_per_second": round(sum(load.rates().values()), 1),
           "cpu_seconds": {k: round(v, 4) for k, v in sorted(run["cpu_seconds"].items())}}
    bare = without_client(costs)
    if bare is not None:
        sim["client_uncharged_seconds"] = RestartRun(ranks, bare, processes=processes, hop=0.0,
                                                     background=load).restart(LIMIT)["seconds"]
    real_row = {k: round(v, 6) if isinstance(v, float) else v for k, v in real.items() if k != "writes"}
    return _side_by_side("restart_barrier_seconds", ranks, real_row, sim, common=common,
                         writes=("writes_per_rank_per_restart", real["writes"] / ranks, run["writes"] / ranks))


def rendezvous_rows(target: Target, kind: Calibration, costs: Costs, *, calibration: str, nodes: int,
                    processes: int) -> list[dict[str, Any]]:
    real = run_rendezvous(target.endpoint, target.credentials, target.metrics_endpoints, nodes, processes)
    run = RendezvousRun(nodes, costs, spare=False, processes=processes)
    res = run.first_round(LIMIT)
    common = {"processes": processes, "etcd": describe(kind), "calibration": calibration}
    sim = {"seconds": res["seconds"], "held": res["nodes_done"],
           "cpu_seconds": {k: round(v, 4) for k, v in sorted(run.sim.cpu_seconds.items())}}
    bare = without_client(costs)
    if bare is not None:
        sim["client_uncharged_seconds"] = RendezvousRun(nodes, bare, spare=False, processes=processes) \
            .first_round(LIMIT)["seconds"]
    real_row = {k: round(v, 6) if isinstance(v, float) else v for k, v in real.items() if k != "writes"}
    return _side_by_side("rendezvous_seconds", nodes, real_row, sim, common=common,
                         writes=("writes_per_node", real["writes"] / nodes, res["writes"] / nodes))
