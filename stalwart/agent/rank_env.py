"""The environment of a rank process: what the agent gives a process it starts for a round, and a warm
spare's parked process before any round. Pure functions of the agent's settings and the round.

A rank gets torchrun's variables (so that unmodified scripts run) and the restart wrapper's ``STALWART_*``
(its epoch, slot, the job's in-process restart settings from the JobRecord), and the path of its handover
file, through which a running process later learns of a new round (:mod:`stalwart.agent.handover`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from stalwart.agent.rendezvous import RoundInfo
from stalwart.agent.settings import PodSettings
from stalwart.api import pod_env
from stalwart.api.job_record import JobRecord
from stalwart.api.pod_env import RankEnvironment, SnapshotEnvironment, TorchrunEnvironment
from stalwart.api.restart_settings import RESTART_SETTINGS

__all__ = ["handover_file", "parked_env", "parked_report", "rank_env", "shared_env", "status_file"]

#: RankEnvironment field -> JobRecord field: the job's in-process restart settings a rank gets.
_JOB_SETTINGS = {setting.option: setting.field for setting in RESTART_SETTINGS}


def handover_file(run_dir: Path, local_rank: int) -> Path:
    return run_dir / f"handover-{local_rank}.json"


def status_file(run_dir: Path, local_rank: int) -> Path:
    return run_dir / f"rank-{local_rank}.json"


def _secrets(s: PodSettings) -> dict[str, str]:
    """Where the etcd credentials are mounted (never the credentials themselves) and the RPC token."""
    env = s.etcd_env()
    if s.rpc_token is not None:
        env[pod_env.RPC_TOKEN] = s.rpc_token.get_secret_value()
    return env


def shared_env(s: PodSettings, base_env: Mapping[str, str]) -> dict[str, str]:
    """What every local rank's environment holds whatever its round: the pod's, and the thread count torchrun
    sets (the fork server imports torch under it, before any rank's own variables exist)."""
    env = dict(base_env)
    if "OMP_NUM_THREADS" not in base_env and s.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does: ranks sharing a node must not oversubscribe it
    return env


def rank_env(s: PodSettings, info: RoundInfo, local_rank: int, *, base_env: Mapping[str, str], run_dir: Path,
             master_port: int, spare_ranks: bool, restarts: int, job: JobRecord | None,
             relay_socket: Path | None = None) -> dict[str, str]:
    """The full environment of local rank ``local_rank`` in the round ``info`` (``relay_socket``: where the
    agent's barrier relay listens, if it does)."""
    m = info.header
    nproc = s.nproc_per_node
    member = info.member
    if member is not None:
        first, group_rank = member.rank_offset, member.group_rank
    else:
        first, group_rank = m.world_size + (info.spare_index or 0) * nproc, m.members
    slots = m.world_size + (m.spares * nproc if spare_ranks else 0)
    slot = first + local_rank
    env = shared_env(s, base_env)
    env.update(TorchrunEnvironment(
        rank=slot, local_rank=local_rank, world_size=m.world_size, local_world_size=nproc, group_rank=group_rank,
        role_rank=slot, role_world_size=m.world_size, master_addr=m.master_addr,
        master_port=m.master_port or master_port, restart_count=restarts, run_id=s.job_uid).to_env())
    settings = {} if job is None else {k: getattr(job, v) for k, v in _JOB_SETTINGS.items()}
    # The job's minimum as it is now (the record follows spec edits); a round never has fewer nodes.
    min_world = min((job.min_nodes if job is not None else s.min_nodes) * nproc, m.world_size)
    renv = RankEnvironment(etcd_endpoints=s.etcd_endpoints, job=s.job, job_uid=s.job_uid, node_id=s.node_id,
                           epoch=info.epoch, slot=slot, slots=max(slots, slot + 1), target_world=m.world_size,
                           min_world=min_world,
                           spare=member is None, status_file=str(status_file(run_dir, local_rank)),
                           local_rank=local_rank, relay_socket=str(relay_socket) if relay_socket else None,
                           **settings)
    env.update(renv.to_env())
    if job is not None:
        policy = job.peer_snapshots
        env.update(SnapshotEnvironment(enabled=policy.enabled, every=policy.every,
                                       memory_limit=policy.memory_limit_bytes()).to_env())
    env[pod_env.HANDOVER_FILE] = str(handover_file(run_dir, local_rank))
    env.update(_secrets(s))
    return env


def parked_report(run_dir: Path, local_rank: int) -> Path:
    return run_dir / f"parked-{local_rank}.json"


def parked_env(s: PodSettings, local_rank: int | None, *, base_env: Mapping[str, str],
               run_dir: Path) -> dict[str, str]:
    """The environment of a parked process before a round takes it (a warm spare's, or the pod's standby):
    no epoch, no slot, no rank; ``local_rank`` ``None``: not even that (a standby of a pod of several local
    ranks; the caller names its handover and report files)."""
    env = shared_env(s, base_env)
    env.update({pod_env.LOCAL_WORLD_SIZE: str(s.nproc_per_node), pod_env.PARKED: "true", pod_env.NODE_ID: s.node_id})
    if local_rank is not None:
        env.update({pod_env.LOCAL_RANK: str(local_rank), pod_env.HANDOVER_FILE: str(handover_file(run_dir, local_rank)),
                    pod_env.PARKED_REPORT: str(parked_report(run_dir, local_rank))})
    env.update(_secrets(s))
    return env
