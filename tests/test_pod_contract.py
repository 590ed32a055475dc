"""The pod contract end to end: what the operator writes, the agent reads; what the agent gives a rank, the
restart wrapper and ``init_rpc()`` read; every error names its variable (stalwart/api/pod_env.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from stalwart.agent.rank_env import parked_env, rank_env
from stalwart.agent.rendezvous import RoundInfo
from stalwart.agent.settings import PodSettings
from stalwart.api import TrainingJob, pod_env
from stalwart.api.job_record import JobRecord
from stalwart.api.manifest import ManifestHeader
from stalwart.api.pod_env import PodEnvError, TorchrunEnvironment, read_env
from stalwart.api.rendezvous import Manifest, Member
from stalwart.api.restart_settings import RESTART_SETTINGS
from stalwart.api.spec import TrainingJobSpec
from stalwart.operator.manifests import AGENT_METRICS_PORT_NAME, ETCD_SECRET_DIR, pod_manifest
from stalwart.restart.config import RestartConfig
from stalwart.restart.environment import RankEnvironment
from stalwart.rpc.environment import RpcEnvironment

SPEC = {"replicas": 2, "nprocPerNode": 2, "rendezvous": {"secretRef": {"name": "etcd-creds"}, "tls": True},
        "template": {"spec": {"containers": [{"name": "trainer", "image": "img", "command": ["python", "t.py"]}]}}}


def _resolve(env: list[dict[str, Any]], pod: str, ip: str, token: str) -> dict[str, str]:
    """What a kubelet makes of the container's env (downward API and the job's Secret)."""
    out = {}
    for e in env:
        ref = e.get("valueFrom", {})
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "fieldRef" in ref:
            fields = {"metadata.name": pod, "metadata.uid": "pod-uid-7", "status.podIP": ip}
            out[e["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        else:
            assert ref["secretKeyRef"]["key"] == "rpc-token"
            out[e["name"]] = token
    return out


def _first_round(s: PodSettings) -> RoundInfo:
    """Round 1 (epoch 5) with ``s``'s pod its one member, ranks 0-1."""
    manifest = Manifest(round=1, members=[
        Member(node_id="train-worker-1", address="10.0.0.7", group_rank=0, rank_offset=0, nproc=2)],
        world_size=2, master_addr="10.0.0.7", master_port=29400, sealed_by="train-worker-1")
    return RoundInfo(node_id=s.node_id, epoch=5, role="member", header=ManifestHeader.of(manifest), node_revision=3,
                     member=manifest.members[0])


def _settings() -> PodSettings:
    spec = TrainingJobSpec.model_validate(SPEC)
    pod = pod_manifest(job="train", namespace="team", uid="uid-1", spec=spec, name="train-worker-1",
                       role="worker", index=1, endpoints=["etcd:2379"])
    return PodSettings.from_env(_resolve(pod["spec"]["containers"][0]["env"], "train-worker-1", "10.0.0.7", "tok"))


def test_what_the_operator_writes_the_agent_reads() -> None:
    s = _settings()
    assert (s.job, s.node_id, s.pod_ip, s.nproc_per_node, s.spare) == ("team/train", "train-worker-1", "10.0.0.7",
                                                                       2, False)
    assert s.pod_uid == "pod-uid-7"  # the incarnation its fence record would name
    assert s.keys.prefix == "/stalwart/v1/team/uid-1/" and s.etcd_secret_dir == ETCD_SECRET_DIR and s.etcd_tls
    assert s.rpc_token is not None and s.rpc_token.get_secret_value() == "tok"


def test_what_the_agent_gives_a_rank_the_wrapper_and_rpc_read(tmp_path: Path) -> None:
    s = _settings()
    manifest = Manifest(round=3, members=[
        Member(node_id="train-worker-0", address="10.0.0.6", group_rank=0, rank_offset=0, nproc=2),
        Member(node_id="train-worker-1", address="10.0.0.7", group_rank=1, rank_offset=2, nproc=2)],
        world_size=4, master_addr="10.0.0.6", master_port=29400, sealed_by="train-worker-0")
    info = RoundInfo(node_id=s.node_id, epoch=42, role="member", header=ManifestHeader.of(manifest), node_revision=7,
                     member=manifest.members[1])
    env = rank_env(s, info, 1, base_env={"PATH": "/bin", pod_env.POD_IP: s.pod_ip}, run_dir=tmp_path,
                   master_port=1234, spare_ranks=False, restarts=2, job=None)
    rank = RankEnvironment.from_env(env)
    assert (rank.epoch, rank.slot, rank.slots, rank.target_world, rank.local_rank) == (42, 3, 4, 4, 1)
    # minReplicas defaults to replicas: 2 nodes of 2 ranks; the job's record, when there is one, says it now.
    assert rank.min_world == 4
    job = TrainingJob.model_validate({"apiVersion": "stalwart.dev/v1alpha1", "kind": "TrainingJob",
                                     "metadata": {"name": "train", "namespace": "team", "uid": "uid-1"},
                                     "spec": {**SPEC, "minReplicas": 1}})
    record = JobRecord.from_job(job, ["train-worker-0", "train-worker-1"])
    later = rank_env(s, info, 1, base_env={}, run_dir=tmp_path, master_port=1234, spare_ranks=False, restarts=0,
                     job=record)
    assert RankEnvironment.from_env(later).min_world == 2
    assert rank.keys == s.keys and env[pod_env.ETCD_SECRET_DIR] == ETCD_SECRET_DIR
    torchrun = read_env(TorchrunEnvironment, pod_env.TORCHRUN_VARIABLES, env)
    assert (torchrun.rank, torchrun.world_size, torchrun.group_rank, torchrun.master_addr, torchrun.master_port,
            torchrun.restart_count) == (3, 4, 1, "10.0.0.6", 29400, 2)
    rpc = RpcEnvironment.from_env(env)
    assert (rpc.rank, rpc.world_size, rpc.host, rpc.token, rpc.epoch) == (3, 4, "10.0.0.7", "tok", 42)
    parked = parked_env(s, 0, base_env={}, run_dir=tmp_path)
    assert parked[pod_env.PARKED] == "true" and pod_env.EPOCH not in parked
    with pytest.raises(PodEnvError, match="STALWART_EPOCH: is required"):
        RankEnvironment.from_env(parked)


def test_a_job_minimum_above_the_rounds_world_is_refused_by_name() -> None:
    env = {pod_env.ETCD_ENDPOINTS: "etcd:2379", pod_env.JOB: "team/train", pod_env.JOB_UID: "uid-1",
           pod_env.NODE_ID: "train-worker-0", pod_env.EPOCH: "5", pod_env.SLOT: "0", pod_env.SLOTS: "2",
           pod_env.TARGET_WORLD: "2", pod_env.MIN_WORLD: "3"}
    with pytest.raises(PodEnvError, match="STALWART_MIN_WORLD 3 exceeds STALWART_TARGET_WORLD 2"):
        RankEnvironment.from_env(env)


def test_the_agents_metrics_port_travels_to_the_agent_and_is_the_trainers_named_port() -> None:
    spec = TrainingJobSpec.model_validate(SPEC)
    plain = pod_manifest(job="train", namespace="team", uid="uid-1", spec=spec, name="train-worker-1",
                         role="worker", index=1, endpoints=["etcd:2379"])
    assert "ports" not in plain["spec"]["containers"][0] and _settings().metrics_port is None
    pod = pod_manifest(job="train", namespace="team", uid="uid-1", spec=spec, name="train-worker-1",
                       role="worker", index=1, endpoints=["etcd:2379"], metrics_port=9400)
    trainer = pod["spec"]["containers"][0]
    assert trainer["ports"] == [{"name": AGENT_METRICS_PORT_NAME, "containerPort": 9400, "protocol": "TCP"}]
    settings = PodSettings.from_env(_resolve(trainer["env"], "train-worker-1", "10.0.0.7", "tok"))
    assert settings.metrics_port == 9400
    with pytest.raises(PodEnvError, match=r"^STALWART_METRICS_PORT: Input should be less than or equal to 65535$"):
        PodSettings.from_env({**_resolve(trainer["env"], "p", "10.0.0.7", "tok"), pod_env.METRICS_PORT: "70000"})


def test_every_bad_variable_is_named_at_once_with_what_was_expected() -> None:
    with pytest.raises(PodEnvError) as e:
        PodSettings.from_env({pod_env.JOB: "no-namespace", pod_env.NPROC_PER_NODE: "0", pod_env.POD_IP: "10.0.0.1",
                              pod_env.NODE_ID: "n"})
    assert set(e.value.problems) >= {
        "STALWART_JOB: expected <namespace>/<name>, got 'no-namespace'",
        "STALWART_JOB_UID: is required (set by the operator)",
        "STALWART_ETCD_ENDPOINTS: is required (set by the operator)"}
    assert any(p.startswith("STALWART_NPROC_PER_NODE: ") for p in e.value.problems)
    with pytest.raises(PodEnvError, match=r"^STALWART_MAX_NODES \(1\) must be >= STALWART_MIN_NODES \(2\)$"):
        PodSettings.from_env({**_settings().etcd_env(), pod_env.JOB: "a/b", pod_env.JOB_UID: "u",
                              pod_env.NODE_ID: "n", pod_env.POD_IP: "10.0.0.1", pod_env.ETCD_ENDPOINTS: "e:1",
                              pod_env.MIN_NODES: "2", pod_env.MAX_NODES: "1"})


def test_every_restart_setting_travels_from_the_spec_to_the_ranks_config(tmp_path: Path) -> None:
    # One distinct value per row of the table (increasing, so the timeouts keep their order): whatever the table
    # holds arrives, through the JobRecord, the agent's rank environment and the variables, in RestartConfig.
    values = {setting.wire: 10 + 2 * i for i, setting in enumerate(RESTART_SETTINGS)}
    s = _settings()
    info = _first_round(s)
    job = TrainingJob.model_validate({"apiVersion": "stalwart.dev/v1alpha1", "kind": "TrainingJob",
                                     "metadata": {"name": "train", "namespace": "team", "uid": "uid-1"},
                                     "spec": {**SPEC, "minReplicas": 1, "restartPolicy": {"inProcess": values}}})
    record = JobRecord.from_job(job, ["train-worker-1"])
    env = rank_env(s, info, 0, base_env={}, run_dir=tmp_path, master_port=1234, spare_ranks=False, restarts=0,
                   job=record)
    assert {setting.env for setting in RESTART_SETTINGS} <= set(env)
    config = RestartConfig().for_job(RankEnvironment.from_env(env).job_settings(), frozenset())
    assert {setting.wire: getattr(config, setting.option) for setting in RESTART_SETTINGS} == values
    # The order the table keeps is checked at each step, naming the setting as that step's user knows it.
    bad = {**values, "softTimeoutSeconds": values["hardTimeoutSeconds"]}
    with pytest.raises(ValidationError, match="softTimeoutSeconds: must be less than hardTimeoutSeconds"):
        TrainingJobSpec.model_validate({**SPEC, "restartPolicy": {"inProcess": bad}})
    with pytest.raises(PodEnvError, match="STALWART_HARD_TIMEOUT: must exceed STALWART_SOFT_TIMEOUT"):
        RankEnvironment.from_env({**env, pod_env.SOFT_TIMEOUT: env[pod_env.HARD_TIMEOUT]})
    with pytest.raises(ValueError, match="hard_timeout: must exceed soft_timeout"):
        RestartConfig().for_job({"soft_timeout": 30.0, "hard_timeout": 30.0}, frozenset())


@pytest.mark.parametrize(("policy", "read"), [
    ({}, pod_env.SnapshotEnvironment(enabled=True, every=1, memory_limit=None)),
    ({"every": 5, "memoryLimit": "2Gi"}, pod_env.SnapshotEnvironment(enabled=True, every=5, memory_limit=2 * 2**30)),
    ({"enabled": False}, pod_env.SnapshotEnvironment(enabled=False, every=1, memory_limit=None)),
])
def test_the_peer_snapshot_policy_travels_from_the_spec_to_the_ranks(policy: dict[str, Any],
                                                                    read: pod_env.SnapshotEnvironment,
                                                                    tmp_path: Path) -> None:
    s = _settings()
    info = _first_round(s)
    job = TrainingJob.model_validate({"apiVersion": "stalwart.dev/v1alpha1", "kind": "TrainingJob",
                                     "metadata": {"name": "train", "namespace": "team", "uid": "uid-1"},
                                     "spec": {**SPEC, "restartPolicy": {"inProcess": {"peerSnapshots": policy}}}})
    env = rank_env(s, info, 0, base_env={}, run_dir=tmp_path, master_port=1234, spare_ranks=False, restarts=0,
                   job=JobRecord.from_job(job, ["train-worker-1"]))
    assert pod_env.SnapshotEnvironment.from_env(env) == read
    # A plain torchrun rank has none of these: no policy, the training function's arguments alone.
    assert pod_env.SnapshotEnvironment.from_env({}) == pod_env.SnapshotEnvironment()
    with pytest.raises(PodEnvError, match="STALWART_SNAPSHOT_EVERY"):
        pod_env.SnapshotEnvironment.from_env({pod_env.SNAPSHOT_EVERY: "0"})
