"""A container's environment as the kubelet builds it: a small base, then ``envFrom`` and ``env`` in order.

- Base: PATH with this interpreter's directory first, HOME, HOSTNAME, the API server's address as
  ``KUBERNETES_SERVICE_HOST/PORT``, a few variables passed through from the control plane (locale, temp dir,
  virtual environment), and the markers of :mod:`.processes` (the cluster's is a digest, not its directory:
  the directory holds the admin's kubeconfig, which a pod must not be pointed at; ``KUBECONFIG`` is never
  passed through).
- ``value`` (with ``$(VAR)`` expansion), ``valueFrom.secretKeyRef``, ``configMapKeyRef``, ``fieldRef``
  (metadata.name/namespace/uid/labels/annotations, spec.nodeName, spec.serviceAccountName, status.podIP/hostIP).
  A missing secret or config map (or key) raises :class:`ConfigError`: the container waits with
  ``CreateContainerConfigError`` until it appears.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.local.apiserver.objects import ApiError, ObjectStore
from stalwart.local.processes import CLUSTER_MARKER, CONTAINER_MARKER, POD_MARKER, cluster_id, container_id

JSON = dict[str, Any]
# Every node of the local cluster is this one machine: a thread cap set for it (OMP_NUM_THREADS) holds for its pods
# too, or each rank of each pod would start a thread per core and spin them on a shared CPU.
_PASSTHROUGH = ("LANG", "LC_ALL", "TZ", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH", "STALWART_ETCD_BIN", "OMP_NUM_THREADS")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


class ConfigError(Exception):
    """A container's environment cannot be built yet (a missing secret, config map or key)."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known variables are replaced, ``$$(VAR)`` escapes, unknown stay."""
    out = re.sub(r"\$\$\(", "\0(", text)
    out = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), out)
    return out.replace("\0(", "$(")


@dataclass(frozen=True)
class Placement:
    """Where a pod runs: what the downward API tells about it."""

    uid: str
    node: str
    ip: str
    home: Path
    host_ip: str = "127.0.0.1"


class PodEnvironment:
    """Builds container environments from the pod and the secrets and config maps in ``store``."""

    def __init__(self, store: ObjectStore, workdir: Path, api_port: int, api_host: str = "127.0.0.1") -> None:
        self.store = store
        self.workdir = workdir
        self.api_port = api_port
        self.api_host = api_host

    def build(self, pod: JSON, where: Placement, container: JSON) -> dict[str, str]:
        meta = pod["metadata"]
        bindir = str(Path(sys.executable).parent)
        env: dict[str, str] = {
            "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/local/bin:/usr/bin:/bin')}",
            "HOME": os.environ.get("HOME", str(where.home)),
            "HOSTNAME": meta["name"],
            "KUBERNETES_SERVICE_HOST": self.api_host,
            "KUBERNETES_SERVICE_PORT": str(self.api_port),
            POD_MARKER: where.uid,
            CONTAINER_MARKER: container_id(where.uid, str(container.get("name", ""))),
            CLUSTER_MARKER: cluster_id(self.workdir),
        }
        for k in _PASSTHROUGH:
            if k in os.environ:
                env[k] = os.environ[k]
        ns = meta["namespace"]
        for src in container.get("envFrom") or []:
            prefix = str(src.get("prefix") or "")
            if "configMapRef" in src:
                data = self._config(ns, "configmaps", src["configMapRef"], None)
            else:
                data = self._config(ns, "secrets", src.get("secretRef") or {}, None)
            for k, v in data.items():
                env[prefix + k] = v
        for item in container.get("env") or []:
            name = str(item.get("name"))
            if "value" in item:
                env[name] = expand(str(item["value"]), env)
                continue
            vf = item.get("valueFrom") or {}
            if "secretKeyRef" in vf:
                val = self._config(ns, "secrets", vf["secretKeyRef"], vf["secretKeyRef"].get("key"))
            elif "configMapKeyRef" in vf:
                val = self._config(ns, "configmaps", vf["configMapKeyRef"], vf["configMapKeyRef"].get("key"))
            elif "fieldRef" in vf:
                val = {"": self._field(pod, where, str(vf["fieldRef"].get("fieldPath", "")))}
            elif "resourceFieldRef" in vf:
                val = {"": "0"}
            else:
                val = {"": ""}
            if val:
                env[name] = next(iter(val.values()))
        self._mount_secrets(pod, where, container, env)
        return env

    def _mount_secrets(self, pod: JSON, where: Placement, container: JSON, env: dict[str, str]) -> None:
        """Secret volumes, as far as processes without a mount namespace allow: each mounted Secret's keys are
        written as files (owner-only) under ``<pod dir>/volumes/<volume>/``, and an environment value naming
        the mount path (or a path under it) is pointed there instead."""
        volumes = {str(v.get("name")): v for v in pod["spec"].get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(str(mount.get("name"))) or {}
            if "secret" not in volume:
                continue
            ref = {"name": volume["secret"].get("secretName"), "optional": volume["secret"].get("optional")}
            data = self._config(pod["metadata"]["namespace"], "secrets", ref, None)
            local = where.home / "volumes" / str(mount["name"])
            local.mkdir(parents=True, exist_ok=True, mode=0o700)
            for key, value in data.items():
                path = local / key
                path.write_text(value)
                path.chmod(0o600)
            target = str(mount.get("mountPath", "")).rstrip("/")
            for name, value in env.items():
                if target and (value == target or value.startswith(target + "/")):
                    env[name] = str(local) + value[len(target):]

    def _config(self, namespace: str, plural: str, ref: JSON, key: str | None) -> dict[str, str]:
        optional = bool(ref.get("optional"))
        kind = "secret" if plural == "secrets" else "configmap"
        try:
            obj = self.store.get(self.store.info("", "v1", plural), namespace, str(ref.get("name")))
        except ApiError:
            if optional:
                return {}
            raise ConfigError(f'{kind} "{ref.get("name")}" not found') from None
        if plural == "secrets":
            data = {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (obj.get("data") or {}).items()}
        else:
            data = {k: str(v) for k, v in (obj.get("data") or {}).items()}
        if key is None:
            return data
        if key not in data:
            if optional:
                return {}
            raise ConfigError(f"couldn't find key {key} in {kind} {namespace}/{ref.get('name')}")
        return {key: data[key]}

    @staticmethod
    def _field(pod: JSON, where: Placement, path: str) -> str:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
        if m:
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        values = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "spec.nodeName": where.node,
                  "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
                  "status.podIP": where.ip, "status.podIPs": where.ip, "status.hostIP": where.host_ip,
                  "status.hostIPs": where.host_ip}
        if path not in values:
            raise ConfigError(f"unsupported fieldRef fieldPath {path!r}")
        return str(values[path])
