"""Safe defaults for the pods the operator creates from a job's template, and the Pod Security Standards check
of that template.

Defaults (:func:`with_defaults`): what the template leaves unsaid is locked down, what it says is kept.

* ``automountServiceAccountToken: false`` -- training code has no business with the Kubernetes API;
* each container (init containers too, privileged ones excepted): ``allowPrivilegeEscalation: false``,
  ``capabilities.drop: [ALL]``, ``runAsNonRoot: true`` (unless the template names user 0) and
  ``seccompProfile: RuntimeDefault``, each only where neither the container nor the pod says it;
* ``/dev/shm`` backed by memory (an ``emptyDir`` with ``medium: Memory``, sized by ``spec.shmSize``): a
  container runtime gives 64 MiB, too little for the RPC layer's shared-memory rings and for DataLoader workers.

Check (:func:`pod_security_problems`): the pod the operator would create (the template with the defaults) is
held against the Pod Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/),
``baseline`` or ``restricted`` (the operator's ``--pod-security``; the chart's ``operator.podSecurity``, default
``restricted``). The published controls are :data:`RULES`, one row per control: its level, the fields it
restricts and the values it allows. ``restricted`` adds one rule of stalwart's own: no Kubernetes API token in
a job's pods (``automountServiceAccountToken: true`` or a projected ``serviceAccountToken``), since the
operator, not the job's author, creates the pods.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["RULES", "SHM_VOLUME", "PodSecurity", "Rule", "pod_security_problems", "privilege_problems",
           "with_defaults"]

SHM_VOLUME = "stalwart-shm"
#: Where the problems are (the pod spec inside a TrainingJob).
TEMPLATE_SPEC = "spec.template.spec"
TEMPLATE_METADATA = "spec.template.metadata"
CONTAINER_KINDS = ("initContainers", "containers", "ephemeralContainers")


class PodSecurity(StrEnum):
    """The Pod Security Standards level the operator holds templates to (``off``: no check)."""

    RESTRICTED = "restricted"
    BASELINE = "baseline"
    OFF = "off"


# -- defaults ------------------------------------------------------------------------------------------------


def _says_root(pod_context: Mapping[str, Any], context: Mapping[str, Any]) -> bool:
    return bool(context.get("runAsUser", pod_context.get("runAsUser")) == 0)


def _container_defaults(container: dict[str, Any], pod_context: Mapping[str, Any]) -> None:
    context = container.setdefault("securityContext", {})
    context.setdefault("allowPrivilegeEscalation", False)
    capabilities = context.setdefault("capabilities", {})
    capabilities.setdefault("drop", ["ALL"])
    if "runAsNonRoot" not in context and "runAsNonRoot" not in pod_context \
            and not _says_root(pod_context, context):
        context["runAsNonRoot"] = True
    if "seccompProfile" not in context and "seccompProfile" not in pod_context:
        context["seccompProfile"] = {"type": "RuntimeDefault"}


def with_defaults(pod_spec: dict[str, Any], *, shm_size: str) -> dict[str, Any]:
    """A copy of ``pod_spec`` with the module's defaults wherever it sets nothing; ``/dev/shm`` is limited to
    ``shm_size`` (a Kubernetes quantity). A privileged container keeps what privilege implies (no defaults);
    a template that mounts its own ``/dev/shm`` keeps it; a template naming user 0 gets no ``runAsNonRoot``."""
    spec = copy.deepcopy(pod_spec)
    spec.setdefault("automountServiceAccountToken", False)
    pod_context: Mapping[str, Any] = spec.get("securityContext") or {}
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    shm = not any(m.get("mountPath", "").rstrip("/") == "/dev/shm"
                  for c in containers for m in c.get("volumeMounts") or [])
    for container in spec.get("initContainers", []):
        if not (container.get("securityContext") or {}).get("privileged"):
            _container_defaults(container, pod_context)
    for container in spec.get("containers", []):
        if not (container.get("securityContext") or {}).get("privileged"):
            _container_defaults(container, pod_context)
        if shm:
            container["volumeMounts"] = [*(container.get("volumeMounts") or []),
                                         {"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    if shm:
        spec["volumes"] = [*(spec.get("volumes") or []),
                           {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}}]
    return spec


# -- the Pod Security Standards, as a table ------------------------------------------------------------------

#: A field a template does not set.
UNSET: Any = type("Unset", (), {"__repr__": lambda self: "unset"})()

_BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
_SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                           "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                           "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                           "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                           "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"})
_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
_RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                 "persistentVolumeClaim", "projected", "secret"})
_APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


@dataclass(frozen=True, slots=True)
class Rule:
    """One control of the Pod Security Standards: at ``level`` (and above), each field ``fields`` finds must
    hold a value ``allowed`` accepts (:data:`UNSET` for a field the pod does not set); ``expects`` says which
    values those are."""

    level: PodSecurity
    control: str
    fields: Callable[[Mapping[str, Any], Mapping[str, Any]], Iterator[tuple[str, Any]]]
    allowed: Callable[[Any], bool]
    expects: str


def _get(obj: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(obj, Mapping) or key not in obj:
            return UNSET
        obj = obj[key]
    return obj


def _pod(*dotted: str) -> Callable[[Mapping[str, Any], Mapping[str, Any]], Iterator[tuple[str, Any]]]:
    def fields(spec: Mapping[str, Any], _meta: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        for d in dotted:
            yield f"{TEMPLATE_SPEC}.{d}", _get(spec, d)
    return fields


def _containers(dotted: str, *, pod_level: str | None = None,
                ) -> Callable[[Mapping[str, Any], Mapping[str, Any]], Iterator[tuple[str, Any]]]:
    """``dotted`` in every container; with ``pod_level``, a container that does not set it takes the pod's
    (the PSS controls that the pod-level field satisfies for all its containers)."""
    def fields(spec: Mapping[str, Any], _meta: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        for kind in CONTAINER_KINDS:
            for i, container in enumerate(spec.get(kind) or []):
                value = _get(container, dotted)
                path = f"{TEMPLATE_SPEC}.{kind}[{i}].{dotted}"
                if value is UNSET and pod_level is not None:
                    value = _get(spec, pod_level)
                    if value is not UNSET:
                        continue  # the pod-level field is checked on its own row
                yield path, value
    return fields


def _list_items(dotted: str, item: str | None = None,
                ) -> Callable[[Mapping[str, Any], Mapping[str, Any]], Iterator[tuple[str, Any]]]:
    """Each entry of the list ``dotted`` in every container (or, with ``item``, the entry's ``item`` field)."""
    def fields(spec: Mapping[str, Any], _meta: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        for kind in CONTAINER_KINDS:
            for i, container in enumerate(spec.get(kind) or []):
                values = _get(container, dotted)
                for j, value in enumerate(values if isinstance(values, list) else []):
                    path = f"{TEMPLATE_SPEC}.{kind}[{i}].{dotted}[{j}]"
                    if item is None:
                        yield path, value
                    else:
                        yield f"{path}.{item}", _get(value, item)
    return fields


def _sysctls(spec: Mapping[str, Any], _meta: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    values = _get(spec, "securityContext.sysctls")
    for j, value in enumerate(values if isinstance(values, list) else []):
        yield f"{TEMPLATE_SPEC}.securityContext.sysctls[{j}].name", _get(value, "name")


def _volume_types(spec: Mapping[str, Any], _meta: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for i, volume in enumerate(spec.get("volumes") or []):
        for key in volume or {}:
            if key != "name":
                yield f"{TEMPLATE_SPEC}.volumes[{i}].{key}", key


def _host_path(spec: Mapping[str, Any], _meta: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for i, volume in enumerate(spec.get("volumes") or []):
        yield f"{TEMPLATE_SPEC}.volumes[{i}].hostPath", _get(volume, "hostPath")


def _apparmor_annotations(_spec: Mapping[str, Any], meta: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(_APPARMOR_ANNOTATION):
            yield f"{TEMPLATE_METADATA}.annotations[{key}]", value


def _service_account_tokens(spec: Mapping[str, Any], _meta: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    yield f"{TEMPLATE_SPEC}.automountServiceAccountToken", _get(spec, "automountServiceAccountToken")
    for i, volume in enumerate(spec.get("volumes") or []):
        sources = _get(volume, "projected.sources")
        for j, source in enumerate(sources if isinstance(sources, list) else []):
            if isinstance(source, Mapping) and "serviceAccountToken" in source:
                yield f"{TEMPLATE_SPEC}.volumes[{i}].projected.sources[{j}].serviceAccountToken", "a token"


def _unset_or(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is UNSET or v in values


B, R = PodSecurity.BASELINE, PodSecurity.RESTRICTED
#: The Pod Security Standards' controls (Kubernetes v1.31), baseline then restricted; a field path names each
#: problem. The last row is stalwart's own (see the module's doc).
RULES: tuple[Rule, ...] = (
    Rule(B, "HostProcess", _pod("securityContext.windowsOptions.hostProcess"), _unset_or(False), "unset or false"),
    Rule(B, "HostProcess", _containers("securityContext.windowsOptions.hostProcess"), _unset_or(False),
         "unset or false"),
    Rule(B, "Host Namespaces", _pod("hostNetwork", "hostPID", "hostIPC"), _unset_or(False), "unset or false"),
    Rule(B, "Privileged Containers", _containers("securityContext.privileged"), _unset_or(False),
         "unset or false"),
    Rule(B, "Capabilities", _list_items("securityContext.capabilities.add"),
         lambda v: v in _BASELINE_CAPABILITIES, f"one of {', '.join(sorted(_BASELINE_CAPABILITIES))}"),
    Rule(B, "HostPath Volumes", _host_path, _unset_or(), "unset"),
    Rule(B, "Host Ports", _list_items("ports", "hostPort"), _unset_or(0), "unset or 0"),
    Rule(B, "AppArmor", _pod("securityContext.appArmorProfile.type"), _unset_or("RuntimeDefault", "Localhost"),
         "unset, RuntimeDefault or Localhost"),
    Rule(B, "AppArmor", _containers("securityContext.appArmorProfile.type"),
         _unset_or("RuntimeDefault", "Localhost"), "unset, RuntimeDefault or Localhost"),
    Rule(B, "AppArmor", _apparmor_annotations,
         lambda v: v == "runtime/default" or (isinstance(v, str) and v.startswith("localhost/")),
         "runtime/default or localhost/*"),
    Rule(B, "SELinux", _pod("securityContext.seLinuxOptions.type"), lambda v: v is UNSET or v in _SELINUX_TYPES,
         f"unset or one of {', '.join(sorted(t for t in _SELINUX_TYPES if t))}"),
    Rule(B, "SELinux", _containers("securityContext.seLinuxOptions.type"),
         lambda v: v is UNSET or v in _SELINUX_TYPES,
         f"unset or one of {', '.join(sorted(t for t in _SELINUX_TYPES if t))}"),
    Rule(B, "SELinux", _pod("securityContext.seLinuxOptions.user", "securityContext.seLinuxOptions.role"),
         _unset_or(""), "unset or empty"),
    Rule(B, "SELinux", _containers("securityContext.seLinuxOptions.user"), _unset_or(""), "unset or empty"),
    Rule(B, "SELinux", _containers("securityContext.seLinuxOptions.role"), _unset_or(""), "unset or empty"),
    Rule(B, "/proc Mount Type", _containers("securityContext.procMount"), _unset_or("Default"),
         "unset or Default"),
    Rule(B, "Seccomp", _pod("securityContext.seccompProfile.type"), _unset_or("RuntimeDefault", "Localhost"),
         "unset, RuntimeDefault or Localhost"),
    Rule(B, "Seccomp", _containers("securityContext.seccompProfile.type"),
         _unset_or("RuntimeDefault", "Localhost"), "unset, RuntimeDefault or Localhost"),
    Rule(B, "Sysctls", _sysctls, lambda v: v in _SAFE_SYSCTLS, f"one of {', '.join(sorted(_SAFE_SYSCTLS))}"),
    Rule(R, "Volume Types", _volume_types, lambda v: v in _RESTRICTED_VOLUMES,
         f"one of {', '.join(sorted(_RESTRICTED_VOLUMES))}"),
    Rule(R, "Privilege Escalation", _containers("securityContext.allowPrivilegeEscalation"),
         lambda v: v is False, "false"),
    Rule(R, "Running as Non-root",
         _containers("securityContext.runAsNonRoot", pod_level="securityContext.runAsNonRoot"),
         lambda v: v is True, "true (here or in the pod's securityContext)"),
    Rule(R, "Running as Non-root", _pod("securityContext.runAsNonRoot"), _unset_or(True), "unset or true"),
    Rule(R, "Running as Non-root user", _pod("securityContext.runAsUser"), lambda v: v != 0, "unset or not 0"),
    Rule(R, "Running as Non-root user", _containers("securityContext.runAsUser"), lambda v: v != 0,
         "unset or not 0"),
    Rule(R, "Seccomp", _containers("securityContext.seccompProfile.type",
                                   pod_level="securityContext.seccompProfile.type"),
         lambda v: v in ("RuntimeDefault", "Localhost"), "RuntimeDefault or Localhost (here or in the pod's)"),
    Rule(R, "Capabilities", _containers("securityContext.capabilities.drop"),
         lambda v: isinstance(v, list) and "ALL" in v, "a list with ALL"),
    Rule(R, "Capabilities", _list_items("securityContext.capabilities.add"), lambda v: v == "NET_BIND_SERVICE",
         "only NET_BIND_SERVICE"),
    Rule(R, "Kubernetes API token (stalwart)", _service_account_tokens, _unset_or(False),
         "unset or false (no service account token in a job's pods)"),
)


def pod_security_problems(pod_spec: Mapping[str, Any], level: PodSecurity,
                          metadata: Mapping[str, Any] | None = None) -> list[tuple[str, str]]:
    """What of ``pod_spec`` (the pod spec the operator would create: a template's, with :func:`with_defaults`)
    the Pod Security Standards' ``level`` refuses, as ``(field path in the TrainingJob, message)`` in
    :data:`RULES` order, each field once. ``metadata`` is the template's (for AppArmor annotations). Empty at
    level ``off``."""
    if level == PodSecurity.OFF:
        return []
    levels = {B} if level == B else {B, R}
    meta = metadata or {}
    problems: dict[str, str] = {}
    for rule in RULES:
        if rule.level not in levels:
            continue
        for path, value in rule.fields(pod_spec, meta):
            if path not in problems and not rule.allowed(value):
                problems[path] = (f"{value!r} is refused by the Pod Security Standards' {rule.level.value} profile "
                                  f"(control {rule.control!r}; allowed: {rule.expects}); the operator runs with "
                                  f"--pod-security={level.value} (the chart's operator.podSecurity)")
    return list(problems.items())


def privilege_problems(pod_spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What of the host a pod of ``pod_spec`` would get: the ``baseline`` problems (kept for callers of the
    former ``--restrict-pod-security`` check)."""
    return pod_security_problems(pod_spec, PodSecurity.BASELINE)
