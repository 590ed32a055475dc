"""What the emulator serves: a description of every resource (built-in ones from kmock's discovery catalogue,
custom ones from stored CustomResourceDefinitions) and the discovery documents built from them."""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]

# Groups in kmock's catalogue that belong to add-ons rather than to kube-apiserver itself.
_SKIPPED_GROUPS = ("gateway.networking.k8s.io", "metrics.k8s.io")
_SERVED_SUBRESOURCES = ("status", "scale", "log", "binding", "eviction", "token", "finalize")
# The "all" category (``kubectl get all``), which the catalogue does not record.
_CATEGORY_ALL = {("", "pods"), ("", "services"), ("", "replicationcontrollers"), ("apps", "deployments"),
                 ("apps", "replicasets"), ("apps", "statefulsets"), ("apps", "daemonsets"), ("batch", "jobs"),
                 ("batch", "cronjobs"), ("autoscaling", "horizontalpodautoscalers")}
_ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass
class ResourceInfo:
    """One served resource at one version. Objects are stored per ``(group, plural)``; the version only sets
    the ``apiVersion`` they are served with (versions of a CRD share one schema-less storage, no conversion)."""
    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    verbs: list[str] = field(default_factory=lambda: list(_ALL_VERBS))
    subresources: dict[str, str] = field(default_factory=dict)  # name -> kind
    crd: JSON | None = None  # the CRD's version entry (schema, printer columns, subresources)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def schema(self) -> JSON | None:
        if self.crd is None:
            return None
        schema = ((self.crd.get("schema") or {}).get("openAPIV3Schema"))
        return schema if isinstance(schema, dict) else None

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    def discovery_entries(self) -> list[JSON]:
        main: JSON = {"name": self.plural, "singularName": self.singular, "namespaced": self.namespaced,
                      "kind": self.kind, "verbs": list(self.verbs)}
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        out = [main]
        for sub, kind in sorted(self.subresources.items()):
            verbs = {"log": ["get"], "binding": ["create"], "eviction": ["create"], "token": ["create"],
                     "finalize": ["update"]}.get(sub, ["get", "patch", "update"])
            out.append({"name": f"{self.plural}/{sub}", "singularName": "", "namespaced": self.namespaced,
                        "kind": kind, "verbs": verbs})
        return out


def _builtin_catalogue() -> list[JSON]:
    data = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
    lists: list[JSON] = json.loads(gzip.decompress(data))
    return [rl for rl in lists if not str(rl.get("groupVersion", "")).startswith(_SKIPPED_GROUPS)]


class Registry:
    """All served resources, looked up by group/version/plural (or by short name/kind for convenience)."""

    def __init__(self) -> None:
        self._by_gvr: dict[tuple[str, str, str], ResourceInfo] = {}
        self._group_order: list[str] = []
        self._versions: dict[str, list[str]] = {}
        for rl in _builtin_catalogue():
            gv = str(rl["groupVersion"])
            group, _, version = gv.rpartition("/")
            mains = [r for r in rl["resources"] if "/" not in r["name"]]
            subs = [r for r in rl["resources"] if "/" in r["name"]]
            for r in mains:
                info = ResourceInfo(
                    group=group, version=version, plural=r["name"], singular=r.get("singularName") or "",
                    kind=r["kind"], namespaced=bool(r.get("namespaced")),
                    short_names=list(r.get("shortNames") or []), categories=list(r.get("categories") or []),
                    verbs=list(r.get("verbs") or []))
                if (group, r["name"]) in _CATEGORY_ALL and "all" not in info.categories:
                    info.categories.append("all")
                for s in subs:
                    parent, _, sub = s["name"].partition("/")
                    if parent == r["name"] and sub in _SERVED_SUBRESOURCES:
                        info.subresources[sub] = s["kind"]
                self.add(info)

    def add(self, info: ResourceInfo) -> None:
        self._by_gvr[(info.group, info.version, info.plural)] = info
        if info.group not in self._group_order:
            self._group_order.append(info.group)
        versions = self._versions.setdefault(info.group, [])
        if info.version not in versions:
            versions.append(info.version)

    def remove_group_resource(self, group: str, plural: str) -> None:
        for key in [k for k in self._by_gvr if k[0] == group and k[2] == plural]:
            del self._by_gvr[key]
        for g in list(self._versions):
            still = {v for (gg, v, _) in self._by_gvr if gg == g}
            self._versions[g] = [v for v in self._versions[g] if v in still]
            if not self._versions[g]:
                del self._versions[g]
                self._group_order.remove(g)

    def get(self, group: str, version: str, plural: str) -> ResourceInfo | None:
        return self._by_gvr.get((group, version, plural))

    def by_kind(self, api_version: str, kind: str) -> ResourceInfo | None:
        group, _, version = api_version.rpartition("/")
        for info in self._by_gvr.values():
            if info.group == group and info.version == version and info.kind == kind:
                return info
        return None

    def versions_of(self, group: str, plural: str) -> list[ResourceInfo]:
        return [i for (g, _, p), i in self._by_gvr.items() if g == group and p == plural]

    def group_versions(self) -> list[tuple[str, list[str]]]:
        return [(g, list(self._versions[g])) for g in self._group_order if g in self._versions]

    def resources(self, group: str, version: str) -> list[ResourceInfo]:
        return [i for (g, v, _), i in self._by_gvr.items() if g == group and v == version]

    # --- discovery documents ---------------------------------------------------------------------------------

    def api_versions(self) -> JSON:
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}

    def api_group(self, group: str) -> JSON | None:
        versions = self._versions.get(group)
        if not group or not versions:
            return None
        gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": gvs,
                "preferredVersion": gvs[0]}

    def api_group_list(self) -> JSON:
        groups = [self.api_group(g) for g, _ in self.group_versions() if g]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [g for g in groups if g]}

    def resource_list(self, group: str, version: str) -> JSON | None:
        infos = self.resources(group, version)
        if not infos:
            return None
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version,
                "resources": [e for i in infos for e in i.discovery_entries()]}
