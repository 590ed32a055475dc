"""The API emulator's object semantics, checked against what the Kubernetes API documentation specifies
(API concepts: resource versions, generation, finalizers, garbage collection, status/scale subresources,
watch, CRD validation and defaulting), on the object store itself."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.objects import ApiError, ObjectStore, WriteOptions
from stalwart.local.apiserver.selectors import parse_field_selector, parse_label_selector

JSON = dict[str, Any]

CRD: JSON = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "jobs.example.dev"},
    "spec": {
        "group": "example.dev", "scope": "Namespaced",
        "names": {"plural": "jobs", "singular": "job", "kind": "Job", "shortNames": ["jb"]},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                     "statusReplicasPath": ".status.replicas"}},
            "additionalPrinterColumns": [{"name": "Phase", "type": "string", "jsonPath": ".status.phase"}],
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "spec": {
                        "type": "object", "required": ["image"],
                        "x-kubernetes-validations": [
                            {"rule": "self.minReplicas <= self.replicas", "message": "minReplicas > replicas"},
                            {"rule": "self.image == oldSelf.image", "message": "image is immutable"},
                        ],
                        "properties": {
                            "image": {"type": "string", "minLength": 1},
                            "replicas": {"type": "integer", "default": 2, "minimum": 1},
                            "minReplicas": {"type": "integer", "default": 1},
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    },
                    "status": {"type": "object", "properties": {"phase": {"type": "string"},
                                                                "replicas": {"type": "integer"}}},
                },
            }},
        }],
    },
}


@pytest.fixture
def store() -> ObjectStore:
    s = ObjectStore(history=1000)
    s.create(s.info("apiextensions.k8s.io", "v1", "customresourcedefinitions"), "", copy.deepcopy(CRD))
    return s


def jobs(store: ObjectStore) -> ResourceInfo:
    return store.info("example.dev", "v1", "jobs")


def cms(store: ObjectStore) -> ResourceInfo:
    return store.info("", "v1", "configmaps")


def job(name: str = "j", **spec: Any) -> JSON:
    return {"apiVersion": "example.dev/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"image": "img", **spec}}


def expect(code: int, reason: str | None = None) -> Any:
    class _Ctx:
        def __enter__(self) -> None:
            return None

        def __exit__(self, et: Any, exc: Any, tb: Any) -> bool:
            assert isinstance(exc, ApiError), f"expected ApiError {code}, got {exc!r}"
            assert exc.code == code, exc.status()
            if reason is not None:
                assert exc.reason == reason, exc.status()
            return True

    return _Ctx()


# --- metadata, resource versions, conflicts ------------------------------------------------------------------

def test_create_sets_server_metadata_and_rejects_duplicates(store: ObjectStore) -> None:
    obj = store.create(jobs(store), "default", job())
    meta = obj["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
    assert meta["namespace"] == "default" and int(meta["resourceVersion"]) > 0
    assert obj["apiVersion"] == "example.dev/v1" and obj["kind"] == "Job"
    with expect(409, "AlreadyExists"):
        store.create(jobs(store), "default", job())


def test_generate_name_and_name_validation(store: ObjectStore) -> None:
    obj = store.create(cms(store), "default", {"metadata": {"generateName": "cm-"}})
    assert obj["metadata"]["name"].startswith("cm-") and len(obj["metadata"]["name"]) == 8
    with expect(422, "Invalid"):
        store.create(cms(store), "default", {"metadata": {"name": "Not_Valid"}})
    with expect(422, "Invalid"):
        store.create(cms(store), "default", {"metadata": {}})


def test_namespace_must_exist(store: ObjectStore) -> None:
    with expect(404, "NotFound"):
        store.create(cms(store), "nowhere", {"metadata": {"name": "a"}})


def test_update_with_stale_resource_version_conflicts(store: ObjectStore) -> None:
    first = store.create(jobs(store), "default", job())
    second = copy.deepcopy(first)
    second["spec"]["replicas"] = 3
    updated = store.update(jobs(store), "default", "j", second)
    assert int(updated["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    first["spec"]["replicas"] = 4
    with expect(409, "Conflict"):
        store.update(jobs(store), "default", "j", first)
    # A merge patch carrying a stale resourceVersion is a conditional write too.
    with expect(409, "Conflict"):
        store.patch(jobs(store), "default", "j", "merge",
                    {"metadata": {"resourceVersion": first["metadata"]["resourceVersion"]}, "spec": {"replicas": 5}})


def test_custom_resource_update_needs_a_resource_version(store: ObjectStore) -> None:
    obj = store.create(jobs(store), "default", job())
    del obj["metadata"]["resourceVersion"]
    with expect(422, "Invalid"):
        store.update(jobs(store), "default", "j", obj)


def test_noop_update_keeps_the_resource_version(store: ObjectStore) -> None:
    obj = store.create(jobs(store), "default", job())
    again = store.update(jobs(store), "default", "j", copy.deepcopy(obj))
    assert again["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_generation_bumps_on_spec_changes_only(store: ObjectStore) -> None:
    store.create(jobs(store), "default", job())
    obj = store.patch(jobs(store), "default", "j", "merge", {"metadata": {"labels": {"a": "b"}}})
    assert obj["metadata"]["generation"] == 1
    obj = store.patch(jobs(store), "default", "j", "merge", {"status": {"phase": "Running"}}, "status")
    assert obj["metadata"]["generation"] == 1
    obj = store.patch(jobs(store), "default", "j", "merge", {"spec": {"replicas": 5}})
    assert obj["metadata"]["generation"] == 2


# --- status and scale subresources ---------------------------------------------------------------------------

def test_status_subresource_separates_spec_and_status(store: ObjectStore) -> None:
    created = store.create(jobs(store), "default", {**job(), "status": {"phase": "Ignored"}})
    assert "status" not in created  # status on create is dropped for a CRD with the status subresource
    store.patch(jobs(store), "default", "j", "merge", {"status": {"phase": "Running"}}, "status")
    obj = store.patch(jobs(store), "default", "j", "merge", {"spec": {"replicas": 4}, "status": {"phase": "X"}})
    assert obj["status"] == {"phase": "Running"} and obj["spec"]["replicas"] == 4
    obj = store.patch(jobs(store), "default", "j", "merge", {"spec": {"replicas": 9}, "status": {"phase": "Done"}},
                      "status")
    assert obj["status"] == {"phase": "Done"} and obj["spec"]["replicas"] == 4


def test_scale_subresource_reads_and_writes_replicas(store: ObjectStore) -> None:
    store.create(jobs(store), "default", job(replicas=3))
    store.patch(jobs(store), "default", "j", "merge", {"status": {"replicas": 2}}, "status")
    scale = store.scale_of(jobs(store), "default", "j")
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 3} and scale["status"]["replicas"] == 2
    store.patch(jobs(store), "default", "j", "merge", {"spec": {"replicas": 6}}, "scale")
    assert store.get(jobs(store), "default", "j")["spec"]["replicas"] == 6


# --- schema: defaulting, pruning, validation, CEL --------------------------------------------------------------

def test_defaulting_and_pruning_of_unknown_fields(store: ObjectStore) -> None:
    obj = store.create(jobs(store), "default", job(extra=1, free={"any": {"thing": 1}}),
                       WriteOptions(field_validation="Ignore"))
    assert obj["spec"] == {"image": "img", "replicas": 2, "minReplicas": 1, "free": {"any": {"thing": 1}}}
    with expect(400, "BadRequest"):
        store.create(jobs(store), "default", job("k", extra=1), WriteOptions(field_validation="Strict"))
    opts = WriteOptions(field_validation="Warn")
    store.create(jobs(store), "default", job("w", extra=1), opts)
    assert opts.warnings == ['unknown field "spec.extra"']


def test_validation_reports_every_problem_with_its_field(store: ObjectStore) -> None:
    with pytest.raises(ApiError) as err:
        store.create(jobs(store), "default", {"metadata": {"name": "bad"},
                                              "spec": {"replicas": 0, "minReplicas": 3, "labels": {"a": 1}}})
    causes = {c["field"]: c["reason"] for c in err.value.details["causes"]}
    assert causes == {"spec.image": "FieldValueRequired", "spec.replicas": "FieldValueInvalid",
                      "spec.labels.a": "FieldValueTypeInvalid", "spec": "FieldValueInvalid"}
    assert err.value.code == 422
    assert 'Job.example.dev "bad" is invalid' in err.value.message
    assert "minReplicas > replicas" in err.value.message


def test_transition_rule_runs_on_update_only(store: ObjectStore) -> None:
    store.create(jobs(store), "default", job())
    with pytest.raises(ApiError) as err:
        store.patch(jobs(store), "default", "j", "merge", {"spec": {"image": "other"}})
    assert "image is immutable" in err.value.message


def test_rules_outside_the_cel_subset_are_reported_as_warnings(store: ObjectStore) -> None:
    crd = copy.deepcopy(CRD)
    crd["metadata"]["name"] = "others.example.dev"
    crd["spec"]["names"] = {"plural": "others", "singular": "other", "kind": "Other"}
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"] = [
        {"rule": "self.metadata.name.quantity() > 1"}]
    opts = WriteOptions()
    store.create(store.info("apiextensions.k8s.io", "v1", "customresourcedefinitions"), "", crd, opts)
    assert len(opts.warnings) == 1 and "not enforced" in opts.warnings[0] and "quantity" in opts.warnings[0]


def test_deleting_a_crd_stops_serving_it_and_removes_its_objects(store: ObjectStore) -> None:
    store.create(jobs(store), "default", job())
    crds = store.info("apiextensions.k8s.io", "v1", "customresourcedefinitions")
    crd = store.get(crds, "", "jobs.example.dev")
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]} == {"NamesAccepted": "True",
                                                                              "Established": "True"}
    w = store.watch(jobs(store), "default", str(store.rv), [], [])
    store.delete(crds, "", "jobs.example.dev")
    deleted, end = w.queue.get_nowait(), w.queue.get_nowait()
    assert deleted is not None and deleted.type == "DELETED" and end is None  # then the watch ends
    with expect(404):
        store.info("example.dev", "v1", "jobs")
    store.create(crds, "", copy.deepcopy(CRD))
    assert store.list_objects(jobs(store), "default")[0] == []


# --- deletion: finalizers, preconditions (garbage collection: test_local_garbage.py) -------------------------

def test_finalizers_hold_an_object_until_removed(store: ObjectStore) -> None:
    store.create(cms(store), "default", {"metadata": {"name": "f", "finalizers": ["example.dev/hold"]}})
    held = store.delete(cms(store), "default", "f")
    assert held["metadata"]["deletionTimestamp"]
    assert store.get(cms(store), "default", "f")["metadata"]["finalizers"] == ["example.dev/hold"]
    with expect(422, "Invalid"):
        store.patch(cms(store), "default", "f", "merge", {"metadata": {"finalizers": ["example.dev/hold", "x/y"]}})
    store.patch(cms(store), "default", "f", "merge", {"metadata": {"finalizers": None}})
    with expect(404):
        store.get(cms(store), "default", "f")


def test_delete_preconditions(store: ObjectStore) -> None:
    store.create(cms(store), "default", {"metadata": {"name": "p"}})
    with expect(409, "Conflict"):
        store.delete(cms(store), "default", "p", {"preconditions": {"uid": "not-the-uid"}})
    with expect(400, "BadRequest"):
        store.delete(cms(store), "default", "p", {"propagationPolicy": "Sometimes"})


# --- list, watch, selectors ------------------------------------------------------------------------------------

def test_list_filters_by_label_and_field_selectors(store: ObjectStore) -> None:
    for name, labels in (("a", {"tier": "web", "env": "prod"}), ("b", {"tier": "db"}), ("c", {})):
        store.create(cms(store), "default", {"metadata": {"name": name, "labels": labels}})
    def names(labels: str = "", fields: str = "") -> list[str]:
        items, _ = store.list_objects(cms(store), "default", parse_label_selector(labels),
                                      parse_field_selector(fields))
        return [i["metadata"]["name"] for i in items]
    assert names("tier=web") == ["a"]
    assert names("tier in (web, db)") == ["a", "b"]
    assert names("tier notin (web)") == ["b", "c"]
    assert names("!tier") == ["c"]
    assert names("tier,env!=prod") == ["b"]  # != also matches objects without the label
    assert names(fields="metadata.name!=a") == ["b", "c"]
    assert names("tier", "metadata.name=b") == ["b"]


def test_watch_from_a_resource_version_and_gone_when_too_old() -> None:
    store = ObjectStore(history=4)
    info = store.info("", "v1", "configmaps")
    first = store.create(info, "default", {"metadata": {"name": "a"}})
    rv = first["metadata"]["resourceVersion"]
    store.patch(info, "default", "a", "merge", {"data": {"k": "v"}})
    store.delete(info, "default", "a")
    w = store.watch(info, "default", rv, [], [])
    events = [w.queue.get_nowait() for _ in range(w.queue.qsize())]
    assert [(e.type, e.obj["metadata"]["name"]) for e in events if e] == [("MODIFIED", "a"), ("DELETED", "a")]
    store.unwatch(w)
    for i in range(6):
        store.create(info, "default", {"metadata": {"name": f"n{i}"}})
    with pytest.raises(ApiError) as err:
        store.watch(info, "default", rv, [], [])
    assert err.value.code == 410 and err.value.reason == "Expired"


def test_watch_without_version_starts_with_the_current_state(store: ObjectStore) -> None:
    store.create(cms(store), "default", {"metadata": {"name": "x", "labels": {"k": "1"}}})
    store.create(cms(store), "default", {"metadata": {"name": "y"}})
    w = store.watch(cms(store), "default", "0", parse_label_selector("k=1"), [])
    first = w.queue.get_nowait()
    assert first is not None and first.type == "ADDED" and first.obj["metadata"]["name"] == "x"
    assert w.queue.empty()
    # Entering the selection is an ADDED for this watch, leaving it a DELETED, as the API server's watch cache
    # reports them.
    store.patch(cms(store), "default", "y", "merge", {"metadata": {"labels": {"k": "1"}}})
    ev = w.queue.get_nowait()
    assert ev is not None and ev.type == "ADDED" and ev.obj["metadata"]["name"] == "y"
    left = store.patch(cms(store), "default", "x", "merge", {"metadata": {"labels": {"k": "2"}}})
    ev = w.queue.get_nowait()
    assert ev is not None and ev.type == "DELETED" and ev.obj["metadata"]["labels"] == {"k": "1"}
    assert ev.obj["metadata"]["resourceVersion"] == left["metadata"]["resourceVersion"]


# --- patch flavours --------------------------------------------------------------------------------------------

def test_strategic_merge_is_refused_for_custom_resources(store: ObjectStore) -> None:
    store.create(jobs(store), "default", job())
    with expect(415, "UnsupportedMediaType"):
        store.patch(jobs(store), "default", "j", "strategic", {"spec": {"replicas": 3}})


def test_json_patch_test_failure_is_unprocessable(store: ObjectStore) -> None:
    store.create(jobs(store), "default", job())
    with expect(422):
        store.patch(jobs(store), "default", "j", "json", [{"op": "test", "path": "/spec/image", "value": "nope"}])
    obj = store.patch(jobs(store), "default", "j", "json",
                      [{"op": "test", "path": "/spec/image", "value": "img"},
                       {"op": "add", "path": "/spec/labels", "value": {"a": "b"}}])
    assert obj["spec"]["labels"] == {"a": "b"}


def test_server_side_apply_creates_and_tracks_managers(store: ObjectStore) -> None:
    opts = WriteOptions(field_manager="alice")
    obj = store.patch(jobs(store), "default", "new", "apply", job("new", replicas=3), opts=opts)
    assert obj["spec"]["replicas"] == 3
    store.patch(jobs(store), "default", "new", "apply",
                {"apiVersion": "example.dev/v1", "kind": "Job", "metadata": {"name": "new"},
                 "spec": {"labels": {"team": "b"}}}, opts=WriteOptions(field_manager="bob"))
    obj = store.patch(jobs(store), "default", "new", "apply", job("new"), opts=WriteOptions(field_manager="alice"))
    # alice gave up replicas (back to its default); bob's labels stay.
    assert obj["spec"]["replicas"] == 2 and obj["spec"]["labels"] == {"team": "b"}
    assert sorted(m["manager"] for m in obj["metadata"]["managedFields"]) == ["alice", "bob"]
    with expect(422):
        store.patch(jobs(store), "default", "new", "apply", job("new"), opts=WriteOptions())


def test_pods_get_defaults_and_pending_status(store: ObjectStore) -> None:
    pods = store.info("", "v1", "pods")
    pod = store.create(pods, "default", {"metadata": {"name": "p"},
                                         "spec": {"containers": [{"name": "c", "image": "i"}]}})
    assert pod["spec"]["restartPolicy"] == "Always" and pod["spec"]["terminationGracePeriodSeconds"] == 30
    assert pod["status"]["phase"] == "Pending"
    with expect(422):
        store.create(pods, "default", {"metadata": {"name": "q"}, "spec": {"containers": [{"name": "c"}]}})
    # Without a kubelet running it, a pod is removed at once.
    store.delete(pods, "default", "p")
    with expect(404):
        store.get(pods, "default", "p")


def test_secret_string_data_is_encoded(store: ObjectStore) -> None:
    secrets = store.info("", "v1", "secrets")
    s = store.create(secrets, "default", {"metadata": {"name": "s"}, "stringData": {"k": "v"}})
    assert s["data"] == {"k": "dg=="} and s["type"] == "Opaque" and "stringData" not in s


def test_dry_run_validates_without_storing(store: ObjectStore) -> None:
    rv = store.rv
    obj = store.create(jobs(store), "default", job(), WriteOptions(dry_run=True))
    assert obj["spec"]["replicas"] == 2  # defaulted as a real create would be
    assert store.rv == rv
    with expect(404):
        store.get(jobs(store), "default", "j")
    with expect(422):
        store.create(jobs(store), "default", job(replicas=0), WriteOptions(dry_run=True))


def test_pod_node_and_restart_policy_are_immutable(store: ObjectStore) -> None:
    pods = store.info("", "v1", "pods")
    store.create(pods, "default", {"metadata": {"name": "p"}, "spec": {
        "nodeName": "n1", "containers": [{"name": "c", "image": "i"}]}})
    with expect(422):
        store.patch(pods, "default", "p", "strategic", {"spec": {"nodeName": "n2"}})
    with expect(422):
        store.patch(pods, "default", "p", "merge", {"spec": {"restartPolicy": "Never"}})
