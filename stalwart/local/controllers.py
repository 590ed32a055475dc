"""The few controllers of kube-controller-manager that the local cluster runs, so that what Helm installs
comes to life:

- Deployments: pods are created straight from ``spec.template`` (there is no ReplicaSet layer), owned by the
  Deployment and labelled with ``pod-template-hash``; the controller keeps ``spec.replicas`` pods of the current
  template that are not being deleted, replaces pods of an older template (all at once, as the ``Recreate``
  strategy does), removes Failed or Succeeded pods, and reports ``replicas``, ``readyReplicas``,
  ``availableReplicas``, ``updatedReplicas``, ``observedGeneration`` and the Available condition.
- Namespaces: each namespace gets its ``default`` ServiceAccount.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import string
from typing import Any

from stalwart.jitter import RNG
from stalwart.local.apiserver.objects import ApiError, Event, ObjectStore, now_rfc3339
from stalwart.local.apiserver.selectors import labels_match, selector_from_label_selector_object
from stalwart.local.loop import ControlLoop

log = logging.getLogger(__name__)
JSON = dict[str, Any]


def template_hash(template: JSON) -> str:
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
    return digest[:10]


class Controllers(ControlLoop):
    """Runs the controllers above on the store's loop; ``start``/``stop`` bracket their life."""

    def __init__(self, store: ObjectStore) -> None:
        super().__init__("controllers", 2.0)
        self.store = store
        self.deployments = store.info("apps", "v1", "deployments")
        self.pods = store.info("", "v1", "pods")
        store.listeners.append(self._on_event)

    def _on_event(self, ev: Event) -> None:
        if (ev.group, ev.plural) in (("apps", "deployments"), ("", "pods"), ("", "namespaces")):
            self.wake()

    def step(self) -> None:
        self.reconcile()

    def reconcile(self) -> None:
        self._service_accounts()
        deployments, _ = self.store.list_objects(self.deployments, None)
        for d in deployments:
            self._deployment(d)

    def _service_accounts(self) -> None:
        sas = self.store.info("", "v1", "serviceaccounts")
        namespaces, _ = self.store.list_objects(self.store.info("", "v1", "namespaces"), None)
        for ns in namespaces:
            name = ns["metadata"]["name"]
            if ns["metadata"].get("deletionTimestamp"):
                continue
            try:
                self.store.get(sas, name, "default")
            except ApiError:
                with contextlib.suppress(ApiError):
                    self.store.create(sas, name, {"metadata": {"name": "default"}})

    def _deployment(self, d: JSON) -> None:
        meta, spec = d["metadata"], d.get("spec") or {}
        if meta.get("deletionTimestamp"):
            return
        ns = meta["namespace"]
        template = copy.deepcopy(spec.get("template") or {})
        h = template_hash(template)
        try:
            selector = selector_from_label_selector_object(spec.get("selector"))
        except ValueError:
            return
        pods, _ = self.store.list_objects(self.pods, ns)
        owned = [p for p in pods if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences")
                                        or []) and labels_match(selector, p["metadata"].get("labels"))]
        live = [p for p in owned if not p["metadata"].get("deletionTimestamp")]
        for p in live:
            labels = p["metadata"].get("labels") or {}
            phase = (p.get("status") or {}).get("phase")
            if labels.get("pod-template-hash") != h or phase in ("Failed", "Succeeded"):
                with contextlib.suppress(ApiError):
                    self.store.delete(self.pods, ns, p["metadata"]["name"])
        current = [p for p in live if (p["metadata"].get("labels") or {}).get("pod-template-hash") == h
                   and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]
        old_terminating = [p for p in owned if p["metadata"].get("deletionTimestamp")
                           and (p["metadata"].get("labels") or {}).get("pod-template-hash") != h]
        want = int(spec.get("replicas", 1))
        if len(current) < want and not old_terminating:
            for _ in range(want - len(current)):
                self._create_pod(d, template, h)
        elif len(current) > want:
            for p in sorted(current, key=lambda p: p["metadata"]["creationTimestamp"], reverse=True)[
                    : len(current) - want]:
                with contextlib.suppress(ApiError):
                    self.store.delete(self.pods, ns, p["metadata"]["name"])
        pods, _ = self.store.list_objects(self.pods, ns)
        mine = [p for p in pods if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences")
                                       or []) and not p["metadata"].get("deletionTimestamp")]
        ready = sum(1 for p in mine if any(c.get("type") == "Ready" and c.get("status") == "True"
                                           for c in (p.get("status") or {}).get("conditions") or []))
        updated = sum(1 for p in mine if (p["metadata"].get("labels") or {}).get("pod-template-hash") == h)
        available = ready >= want
        old_status = d.get("status") or {}
        old_cond = next((c for c in old_status.get("conditions") or [] if c.get("type") == "Available"), None)
        cond_status = "True" if available else "False"
        cond = {"type": "Available", "status": cond_status,
                "reason": "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
                "message": "Deployment has minimum availability." if available
                else "Deployment does not have minimum availability.",
                "lastTransitionTime": old_cond["lastTransitionTime"]
                if old_cond and old_cond.get("status") == cond_status else now_rfc3339()}
        status = {"observedGeneration": meta.get("generation", 1), "replicas": len(mine), "readyReplicas": ready,
                  "availableReplicas": ready, "updatedReplicas": updated, "conditions": [cond]}
        if status != {k: old_status.get(k) for k in status}:
            d2 = copy.deepcopy(d)
            d2["status"] = status
            with contextlib.suppress(ApiError):
                self.store.update(self.deployments, ns, meta["name"], d2, "status")

    def _create_pod(self, d: JSON, template: JSON, h: str) -> None:
        meta = d["metadata"]
        suffix = "".join(RNG.choices(string.ascii_lowercase + string.digits, k=5))
        pmeta = copy.deepcopy(template.get("metadata") or {})
        pmeta["name"] = f"{meta['name']}-{h[:8]}-{suffix}"
        pmeta["namespace"] = meta["namespace"]
        pmeta.setdefault("labels", {})["pod-template-hash"] = h
        pmeta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                     "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": pmeta, "spec": copy.deepcopy(template.get("spec") or {})}
        try:
            self.store.create(self.pods, meta["namespace"], pod)
        except ApiError as exc:
            log.warning("deployment %s/%s: cannot create a pod: %s", meta["namespace"], meta["name"], exc.message)
