"""Builders of operator observations for the table-driven tests of the pure core."""

from __future__ import annotations

import copy
from typing import Any

from stalwart.api.rendezvous import Manifest, Member
from stalwart.api.restart import FailureInfo, ProgressRecord, RankExit, RankReport, RoundSummary
from stalwart.api.status import Phase, RestartCounts, TrainingJobStatus
from stalwart.operator.model import (
    Action,
    Decision,
    EtcdView,
    JobView,
    Observation,
    PodView,
)
from stalwart.operator.observe import job_view

NOW = 1_800_000_000.0
JOB = "train"


def spec(**over: Any) -> dict[str, Any]:
    """A valid TrainingJob spec (wire form) with ``over`` merged in (dicts merge one level deep)."""
    base: dict[str, Any] = {
        "replicas": 2,
        "template": {"spec": {"containers": [{"name": "trainer", "image": "img",
                                              "command": ["python", "train.py"]}]}},
        "rendezvous": {"endpoints": ["127.0.0.1:2379"]},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def job(status: TrainingJobStatus | None = None, generation: int = 1, deleting: bool = False,
        **spec_over: Any) -> JobView:
    body: dict[str, Any] = {
        "metadata": {"name": JOB, "namespace": "ns", "uid": "uid-1", "generation": generation},
        "spec": spec(**spec_over),
    }
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2027-01-01T00:00:00Z"
    view = job_view(body)
    if status is not None:
        view = JobView(**{**{k: getattr(view, k) for k in view.__slots__}, "status": status})
    return view


def raw_job(body_spec: dict[str, Any], name: str = JOB) -> JobView:
    return job_view({"metadata": {"name": name, "namespace": "ns", "uid": "uid-1", "generation": 1},
                     "spec": copy.deepcopy(body_spec)})


def pod(name: str, phase: str = "Running", **kw: Any) -> PodView:
    """A pod named ``worker-N`` / ``spare-N`` (the job name is prefixed)."""
    role, _, index = name.partition("-")
    kw.setdefault("ready", phase == "Running")
    return PodView(name=f"{JOB}-{name}", role=role, index=int(index), phase=phase,  # type: ignore[arg-type]
                   **kw)


def status(phase: Phase | None, replacements: int = 0, in_process: int = 0, **kw: Any) -> TrainingJobStatus:
    kw.setdefault("selector", f"stalwart.dev/job-name={JOB}")
    kw.setdefault("observed_generation", 1)
    return TrainingJobStatus(phase=phase, restarts=RestartCounts(in_process=in_process,
                                                                 pod_replacements=replacements), **kw)


def manifest(*names: str, round_: int = 1, nproc: int = 1) -> Manifest:
    members = [Member(node_id=f"{JOB}-{n}", address=f"10.0.0.{i}", group_rank=i, rank_offset=i * nproc,
                      nproc=nproc) for i, n in enumerate(names)]
    return Manifest(round=round_, members=members, world_size=len(names) * nproc, master_addr="10.0.0.0",
                    sealed_by=members[0].node_id)


def etcd(*members: str, leases: dict[str, int] | None = None, epoch: int = 7, **kw: Any) -> EtcdView:
    return EtcdView(manifest=manifest(*members) if members else None, epoch=epoch if members else 0,
                    leases={f"{JOB}-{k}": v for k, v in (leases or {}).items()}, **kw)


def progress(node: str, *, epoch: int = 7, state: str = "running", step: int | None = None,
             restarts: int = 0, failure: FailureInfo | None = None, updated: float = NOW, round_: int = 1,
             ranks: tuple[RankReport, ...] = (), exits: tuple[RankExit, ...] = (),
             history: tuple[RoundSummary, ...] = ()) -> ProgressRecord:
    return ProgressRecord(node_id=f"{JOB}-{node}", epoch=epoch, round=round_, state=state,  # type: ignore[arg-type]
                          step=step, restarts_in_process=restarts, last_failure=failure, updated=updated,
                          ranks=list(ranks), exits=list(exits), history=list(history))


def rank_report(slot: int, *, rank: int | None = None, state: str = "running", iteration: int = 0,
                step: int | None = None, step_time: float | None = None, first_step: int | None = None,
                progress_time: float | None = NOW - 0.5) -> RankReport:
    return RankReport(local_rank=0, slot=slot, rank=slot if rank is None else rank, pid=100 + slot,
                      state=state, iteration=iteration, step=step,  # type: ignore[arg-type]
                      step_time=step_time if step_time is not None or step is None else NOW - 0.5,
                      first_step=first_step, progress_time=progress_time)


def stepping(node: str, slot: int, *, step: int = 10, round_: int = 1, iteration: int = 0, epoch: int = 7,
             respawned: tuple[int, ...] = (), earlier: tuple[RoundSummary, ...] = (),
             exits: tuple[RankExit, ...] = (), updated: float = NOW) -> ProgressRecord:
    """A node whose rank (``slot``) completes steps in ``round_``/``iteration`` (its history says so)."""
    return progress(node, epoch=epoch, round_=round_, step=step, updated=updated, exits=exits, restarts=iteration,
                    ranks=(rank_report(slot, iteration=iteration, step=step, first_step=step),),
                    history=(*earlier, RoundSummary(round=round_, epoch=epoch, stepped=iteration,
                                                     respawned=list(respawned))))


def observe(jobv: JobView, pods: list[PodView], etcd_view: EtcdView | None = None, *, now: float = NOW,
            last_patch: float | None = None, ready: bool = True) -> Observation:
    return Observation(job=jobv, pods=tuple(pods), etcd=etcd_view or EtcdView(), now=now,
                       last_status_patch=last_patch, owned_objects_ready=ready)


def of(decision: Decision, kind: type[Action]) -> list[Any]:
    return [a for a in decision.actions if isinstance(a, kind)]
