"""The operator's pure edges: raw pod/job/etcd data -> observations, the objects it creates, its RBAC list."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from opbuild import JOB, NOW, etcd, job, observe, progress, spec, status

from stalwart.api.manifest import encode_manifest, manifest_part_key
from stalwart.api.rendezvous import ExpectedNodes, Manifest, Member
from stalwart.api.spec import TrainingJobSpec
from stalwart.api.status import Phase, Position
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import KeyValue
from stalwart.operator import rbac
from stalwart.operator.manifests import (
    AGENT_COMMAND,
    pod_group_manifest,
    pod_manifest,
    secret_manifest,
    service_manifest,
)
from stalwart.operator.model import PatchStatus, PodView
from stalwart.operator.observe import etcd_view, job_view, overlay, parse_time, pod_view
from stalwart.operator.reconcile import reconcile


def pod_body(name: str = f"{JOB}-worker-1", phase: str = "Running", **status: Any) -> dict[str, Any]:
    role, index = name.split("-")[-2:]
    return {"metadata": {"name": name, "labels": {"stalwart.dev/job-name": JOB, "stalwart.dev/role": role,
                                                  "stalwart.dev/index": index}},
            "spec": {"containers": [{"name": "trainer"}, {"name": "sidecar"}]},
            "status": {"phase": phase, **status}}


def test_pod_view_of_a_running_ready_pod() -> None:
    view = pod_view(pod_body(conditions=[{"type": "Ready", "status": "True"}]))
    assert view == PodView(name=f"{JOB}-worker-1", role="worker", index=1, phase="Running", ready=True)


def test_pod_view_reads_the_trainer_exit_code_not_the_sidecar() -> None:
    view = pod_view(pod_body(phase="Failed", containerStatuses=[
        {"name": "sidecar", "state": {"terminated": {"exitCode": 0}}},
        {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]))
    assert view is not None and view.exit_code == 137 and view.reason == "OOMKilled"


def test_pod_view_deletion_and_unschedulable() -> None:
    body = pod_body(phase="Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}])
    body["metadata"].update(deletionTimestamp="2027-01-01T00:00:30Z", deletionGracePeriodSeconds=30)
    view = pod_view(body)
    assert view is not None and view.unschedulable and view.deletion_grace == 30
    assert view.deleting_since == parse_time("2027-01-01T00:00:00Z")


def test_pod_view_ignores_pods_without_stalwart_labels() -> None:
    assert pod_view({"metadata": {"name": "x", "labels": {}}, "status": {}}) is None
    body = pod_body()
    body["metadata"]["labels"]["stalwart.dev/index"] = "one"
    assert pod_view(body) is None


def test_job_view_names_the_bad_field() -> None:
    view = job_view({"metadata": {"name": JOB, "uid": "u", "generation": 3},
                     "spec": {**spec(), "nprocPerNode": 0}})
    assert view.spec is None and view.spec_problem is not None
    assert view.spec_problem[0] == "spec.nprocPerNode"
    ok = job_view({"metadata": {"name": JOB, "namespace": "ns", "uid": "u", "generation": 3}, "spec": spec(),
                   "status": {"phase": "Running", "unknownThing": 1}})
    assert ok.spec is not None and ok.generation == 3 and ok.status.phase is None  # unreadable status: reset


def test_etcd_view_parses_records_and_skips_corrupt_ones() -> None:
    keys = JobKeys("ns", "uid-1")
    manifest = Manifest(round=2, members=[Member(node_id="a", address="1", group_rank=0, rank_offset=0,
                                                 nproc=1)], world_size=1, master_addr="1", sealed_by="a")

    def kv(key: str, value: bytes, mod: int = 1, lease: int = 0) -> KeyValue:
        return KeyValue(key, value, 1, mod, 1, lease)

    view = etcd_view(keys, [
        kv(keys.rendezvous + "manifest", manifest.to_json_bytes(), mod=42),
        kv(keys.rendezvous + "nodes/a", b"{}", lease=77),
        kv(keys.rendezvous + "expected", ExpectedNodes(node_ids=["a"]).to_json_bytes()),
        kv(keys.rendezvous + "closed", b"{}"),
        kv(keys.progress + "a", progress("worker-0").to_json_bytes()),
        kv(keys.progress + "b", b"not json"),
        kv(keys.job, b"{\"jobName\": 1}"),
    ])
    assert view.manifest == manifest and view.epoch == 42 and view.leases == {"a": 77}
    assert view.expected == ("a",) and view.closed and len(view.progress) == 1 and view.record is None


def test_etcd_view_assembles_a_manifest_in_buckets_and_skips_one_whose_buckets_are_of_another_round() -> None:
    keys = JobKeys("ns", "uid-1")
    members = [Member(node_id=f"w-{i}", address=f"10.0.{i // 256}.{i % 256}", group_rank=i, rank_offset=i,
                      nproc=1) for i in range(40)]
    manifest = Manifest(round=1, members=members, world_size=40, master_addr="10.0.0.0", sealed_by="w-0")
    header, parts = encode_manifest(manifest, part_bytes=1024)

    other_members = [m.model_copy(update={"address": "10.9.9.9"}) for m in members]
    _, other = encode_manifest(manifest.model_copy(update={"members": other_members}), part_bytes=1024)

    def kvs(buckets: list[bytes]) -> list[KeyValue]:
        return [KeyValue(keys.rendezvous + "manifest", header, 1, 42, 1, 0),
                *(KeyValue(keys.rendezvous + manifest_part_key(i), p, 1, 42, 1, 0) for i, p in enumerate(buckets))]

    assert len(parts) > 1
    view = etcd_view(keys, kvs(parts))
    assert view.manifest == manifest and view.epoch == 42
    stale = etcd_view(keys, kvs([parts[0], *other[1:]]))  # buckets of another round's manifest
    assert stale.manifest is None and stale.epoch == 0


def test_overlay_shows_created_and_deleted_pods_until_the_watch_catches_up() -> None:
    watched = [PodView(name="p0", role="worker", index=0, phase="Running")]
    created = {"p1": (PodView(name="p1", role="worker", index=1, phase="Pending"), NOW - 1),
               "old": (PodView(name="old", role="spare", index=0, phase="Pending"), NOW - 100)}
    pods = overlay(watched, created, {"p0": (30, NOW - 2)}, NOW)
    assert [p.name for p in pods] == ["p0", "p1"]
    assert pods[0].deleting_since == NOW - 2 and pods[0].deletion_grace == 30
    # Only the watch's pods are real to the vanished-pod rule; the created one is assumed.
    assert not pods[0].assumed and pods[1].assumed


def test_written_status_is_patched_once_the_rate_limit_allows() -> None:
    decided = status(Phase.RUNNING, round=3)
    written = status(Phase.STARTING)
    from opbuild import pod as mkpod
    from opbuild import stepping

    decided = decided.model_copy(update={"position": Position(round=1, iteration=0)})
    pods = [mkpod("worker-0"), mkpod("worker-1")]
    obs = observe(job(decided), pods, etcd("worker-0", "worker-1", progress=(stepping("worker-0", 0),)),
                  last_patch=NOW - 5)
    obs = type(obs)(**{**{k: getattr(obs, k) for k in obs.__slots__}, "written_status": written})
    d = reconcile(obs)
    (patch,) = [a for a in d.actions if isinstance(a, PatchStatus)]
    assert patch.status.phase == Phase.RUNNING
    assert not [a for a in d.actions if type(a).__name__ == "EmitEvent"]  # already emitted when decided


# -- manifests -------------------------------------------------------------------------------------------------


def test_pod_manifest_wraps_the_command_and_sets_the_environment() -> None:
    s = TrainingJobSpec.model_validate({**spec(spares=1, nprocPerNode=4), "template": {
        "metadata": {"labels": {"team": "a"}, "annotations": {"x": "y"}},
        "spec": {"nodeSelector": {"gpu": "h100"}, "containers": [
            {"name": "trainer", "image": "img", "command": ["python", "t.py"], "args": ["--lr", "1"],
             "env": [{"name": "A", "value": "1"}, {"name": "STALWART_SPARE", "value": "spoof"}]},
            {"name": "sidecar", "image": "img2", "command": ["sleep", "1"]}]}},
        "rendezvous": {"secretRef": {"name": "etcd-creds"}, "tls": True}})
    pod = pod_manifest(job=JOB, namespace="ns", uid="u1", spec=s, name=f"{JOB}-spare-0", role="spare", index=0,
                       endpoints=["e1:2379", "e2:2379"])
    meta, ps = pod["metadata"], pod["spec"]
    assert meta["labels"] == {"team": "a", "stalwart.dev/job-name": JOB, "stalwart.dev/role": "spare",
                              "stalwart.dev/index": "0"}
    assert meta["annotations"] == {"x": "y"} and meta["ownerReferences"][0]["uid"] == "u1"
    assert meta["ownerReferences"][0]["controller"] is True
    trainer = ps["containers"][0]
    assert trainer["command"] == [*AGENT_COMMAND, "python", "t.py", "--lr", "1"] and "args" not in trainer
    env = {e["name"]: e for e in trainer["env"]}
    assert env["STALWART_SPARE"]["value"] == "true"  # the user cannot spoof stalwart's variables
    assert env["A"]["value"] == "1"
    assert env["STALWART_ETCD_ENDPOINTS"]["value"] == "e1:2379,e2:2379"
    assert env["STALWART_NPROC_PER_NODE"]["value"] == "4" and env["STALWART_JOB"]["value"] == f"ns/{JOB}"
    assert env["STALWART_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["STALWART_RPC_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": f"{JOB}-stalwart",
                                                                      "key": "rpc-token"}
    assert env["STALWART_ETCD_TLS"]["value"] == "true"
    assert ps["containers"][1]["command"] == ["sleep", "1"]  # only the trainer runs under the agent
    # Issue 31, finding 4: the credentials are the trainer's alone; a sidecar gets no token and no etcd mount.
    sidecar = ps["containers"][1]
    sidecar_env = {e["name"] for e in sidecar["env"]}
    assert {"STALWART_RPC_TOKEN", "STALWART_ETCD_SECRET_DIR", "STALWART_ETCD_TLS"}.isdisjoint(sidecar_env)
    assert "STALWART_JOB" in sidecar_env
    assert [m["mountPath"] for m in sidecar["volumeMounts"]] == ["/dev/shm"]
    assert {"name": "stalwart-etcd-credentials", "mountPath": "/etc/stalwart/etcd", "readOnly": True} \
        in trainer["volumeMounts"]
    assert {"name": "stalwart-etcd-credentials", "secret": {"secretName": "etcd-creds"}} in ps["volumes"]
    assert ps["restartPolicy"] == "Never" and ps["hostname"] == f"{JOB}-spare-0" and ps["subdomain"] == JOB
    assert ps["nodeSelector"] == {"gpu": "h100"}
    bare = pod_manifest(job=JOB, namespace="ns", uid="u1", spec=s, name=f"{JOB}-worker-0", role="worker",
                        index=0, endpoints=["e1:2379"], agent_command=())
    assert bare["spec"]["containers"][0]["command"] == ["python", "t.py", "--lr", "1"]


@pytest.mark.parametrize(("shm_size", "limit"), [(None, "1Gi"), ("16Gi", "16Gi")])
def test_pod_manifest_mounts_a_memory_backed_shm_sized_by_the_spec(shm_size: str | None, limit: str) -> None:
    s = TrainingJobSpec.model_validate(spec() if shm_size is None else spec(shmSize=shm_size))
    ps = pod_manifest(job=JOB, namespace="ns", uid="u", spec=s, name=f"{JOB}-worker-0", role="worker", index=0,
                      endpoints=["e1:2379"])["spec"]
    shm = [v for v in ps["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert shm == [{"name": "stalwart-shm", "emptyDir": {"medium": "Memory", "sizeLimit": limit}}]
    assert {"name": "stalwart-shm", "mountPath": "/dev/shm"} in ps["containers"][0]["volumeMounts"]


def test_pod_manifest_needs_endpoints() -> None:
    s = TrainingJobSpec.model_validate({k: v for k, v in spec().items() if k != "rendezvous"})
    with pytest.raises(ValueError, match="endpoints"):
        pod_manifest(job=JOB, namespace="ns", uid="u", spec=s, name="n", role="worker", index=0, endpoints=[])


def test_service_and_secret() -> None:
    svc = service_manifest(job=JOB, namespace="ns", uid="u")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"stalwart.dev/job-name": JOB}
    secret = secret_manifest(job=JOB, namespace="ns", uid="u", token="t" * 64, made_by="v1:ab")
    assert base64.b64decode(secret["data"]["rpc-token"]) == b"t" * 64
    assert secret["metadata"]["annotations"] == {"stalwart.dev/made-by": "v1:ab"}
    with pytest.raises(ValueError, match="token"):
        secret_manifest(job=JOB, namespace="ns", uid="u", token="short", made_by="v1:ab")


# -- RBAC ------------------------------------------------------------------------------------------------------


def test_rbac_list_is_least_privilege_and_covers_the_adapter() -> None:
    need = rbac.required(peering=False, clusterwide=True)
    for verbs in need.values():
        assert not {"*", "escalate", "bind", "impersonate", "deletecollection"} & verbs
    assert not {"update", "patch"} & need[("", "secrets")]
    # Every call of the Kubernetes adapter (stalwart/operator/kube.py) is covered.
    for resource, verb in [("pods", "create"), ("pods", "delete"), ("services", "create"), ("secrets", "create"),
                           ("events", "create")]:
        assert verb in need[("", resource)]
    assert "patch" in need[("stalwart.dev", "trainingjobs/status")]
    assert "delete" in need[("stalwart.dev", "trainingjobs")]
    assert ("kopf.dev", "clusterkopfpeerings") not in need
    assert ("kopf.dev", "clusterkopfpeerings") in rbac.required(peering=True, clusterwide=True)
    assert ("kopf.dev", "kopfpeerings") in rbac.required(peering=True, clusterwide=False)



@pytest.mark.parametrize(("gang", "api_version"), [("volcano", "scheduling.volcano.sh/v1beta1"),
                                                    ("coscheduling", "scheduling.x-k8s.io/v1alpha1")])
def test_pod_group_and_gang_pods(gang: str, api_version: str) -> None:
    group = pod_group_manifest(gang=gang, job=JOB, namespace="ns", uid="u", min_member=3)
    assert group["apiVersion"] == api_version and group["spec"] == {"minMember": 3}
    assert group["metadata"]["ownerReferences"][0]["uid"] == "u"
    s = TrainingJobSpec.model_validate(spec())
    pod = pod_manifest(job=JOB, namespace="ns", uid="u", spec=s, name=f"{JOB}-worker-0", role="worker", index=0,
                       endpoints=["e:1"], gang=gang)
    if gang == "volcano":
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == JOB
    else:
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == JOB
        assert "schedulerName" not in pod["spec"]
    assert ("scheduling.volcano.sh", "podgroups") in rbac.required(peering=False, clusterwide=True,
                                                                  gang="volcano")
    assert ("scheduling.volcano.sh", "podgroups") not in rbac.required(peering=False, clusterwide=True)
    with pytest.raises(ValueError, match="gang scheduler"):
        pod_group_manifest(gang="kueue", job=JOB, namespace="ns", uid="u", min_member=1)


def test_a_queued_job_puts_its_pods_in_one_kueue_pod_group() -> None:
    s = TrainingJobSpec.model_validate(spec(replicas=2, spares=1))
    pod = pod_manifest(job=JOB, namespace="ns", uid="u", spec=s, name=f"{JOB}-worker-3", role="worker", index=3,
                       endpoints=["e1:2379"], queue="team-a")
    meta = pod["metadata"]
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == JOB  # replacements join the same group
    assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"  # workers and spares
    plain = pod_manifest(job=JOB, namespace="ns", uid="u", spec=s, name=f"{JOB}-worker-0", role="worker", index=0,
                         endpoints=["e1:2379"])["metadata"]
    assert not [k for k in {**plain["labels"], **plain["annotations"]} if k.startswith("kueue.x-k8s.io/")]


@pytest.mark.parametrize(("labels", "queue"), [
    ({"kueue.x-k8s.io/queue-name": "team-a"}, "team-a"),
    ({"kueue.x-k8s.io/queue-name": ""}, None),
    ({"other": "x"}, None),
    (None, None),
])
def test_job_view_reads_the_kueue_queue_label(labels: dict[str, str] | None, queue: str | None) -> None:
    meta: dict[str, object] = {"name": JOB, "namespace": "ns", "uid": "u"}
    if labels is not None:
        meta["labels"] = labels
    assert job_view({"metadata": meta, "spec": spec()}).queue_name == queue
