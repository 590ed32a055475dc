"""The local cluster's control-plane process: a real etcd, the API emulator (with the DefaultTolerationSeconds
admission plugin), the scheduler, the process kubelet, the node lifecycle controller and the controllers of
:mod:`.controllers` and :mod:`.garbage`, run until SIGTERM/SIGINT. ``stalwart local up`` starts it in the
background (``python -m stalwart.local.controlplane``); it starts from a clean ``<dir>/etcd``, ``<dir>/pods`` and
``<dir>/pki`` (a new CA and serving certificate: the API serves HTTPS), writes ``<dir>/kubeconfig`` (the admin's
token and the CA) and, once everything serves, ``<dir>/state.json`` (see :mod:`.cluster`).

With a network per node (settings ``network``: netns, or auto where this process may make namespaces; see
:mod:`.netns`) it makes that network first; etcd then listens on the bridge's etcd address and the API server on
its API address, the addresses every node reaches. Without one, both listen on 127.0.0.1.

On shutdown it stops every pod (SIGTERM, SIGKILL after a short grace), the HTTP server and etcd, removes the
network it made and ``state.json``. Containers are started with a parent-death signal, so even a killed control
plane leaves no container behind (and ``down`` removes the network such a one recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from pydantic import ValidationError

from stalwart.local.admission import default_toleration_seconds
from stalwart.local.apiserver.http import ApiServer
from stalwart.local.apiserver.objects import ObjectStore
from stalwart.local.apiserver.security import new_security
from stalwart.local.controllers import Controllers
from stalwart.local.etcd import EtcdServer
from stalwart.local.garbage import GarbageCollector
from stalwart.local.kubelet import ProcessKubelet
from stalwart.local.netns import NetworkUnavailable, NodeNetwork
from stalwart.local.netplan import PlanError, parse_cut
from stalwart.local.nodelifecycle import NodeLifecycleController
from stalwart.local.pki import create as create_pki
from stalwart.local.scheduler import Scheduler
from stalwart.local.settings import LocalClusterSettings
from stalwart.net import free_port

log = logging.getLogger(__name__)
STATE_FILE = "state.json"
KUBECONFIG_FILE = "kubeconfig"


def kubeconfig(api_url: str, token: str, ca_pem: bytes, name: str = "stalwart-local",  # noqa: PLR0917
               user: str = "admin", namespace: str = "default") -> dict[str, Any]:
    """A kubeconfig for the emulator (HTTPS on loopback, trusting the cluster CA ``ca_pem``) authenticating with
    a bearer ``token``."""
    ca_data = base64.b64encode(ca_pem).decode()
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": name, "preferences": {},
        "clusters": [{"name": name, "cluster": {"server": api_url, "certificate-authority-data": ca_data}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": user, "namespace": namespace}}],
    }


def _add_admin_routes(app: web.Application, kubelet: ProcessKubelet, controller: NodeLifecycleController) -> None:
    async def lose(request: web.Request) -> web.Response:
        node = request.match_info["node"]
        partition = request.query.get("partition", "false") == "true"
        try:
            pods = await kubelet.lose_node(node, partition=partition)
        except KeyError as exc:
            return web.json_response({"error": str(exc.args[0])}, status=404)
        return web.json_response({"node": node, "state": kubelet.nodes[node], "pods": pods})

    async def restore(request: web.Request) -> web.Response:
        node = request.match_info["node"]
        try:
            await kubelet.restore_node(node)
        except KeyError as exc:
            return web.json_response({"error": str(exc.args[0])}, status=404)
        # The controller looks now rather than at its next period: whoever restored the node (a test, the CLI)
        # gets it back Ready and untainted, so the next pod it creates is scheduled as on a healthy cluster.
        try:
            controller.tick()
        except Exception:
            log.exception("node lifecycle controller failed")
        return web.json_response({"node": node, "state": kubelet.nodes[node]})

    async def nodes(request: web.Request) -> web.Response:
        network = kubelet.network
        cuts = network.cuts if network else {}
        return web.json_response({"nodes": [{"name": n, "state": s, **({"cut_from": cuts[n].describe()}
                                                                         if n in cuts else {})}
                                            for n, s in kubelet.nodes.items()],
                                  "pods": len(kubelet.runs)})

    async def partition(request: web.Request) -> web.Response:
        node = request.match_info["node"]
        network = kubelet.network
        if network is None:
            return web.json_response({"error": "network faults need a network per node; this cluster runs in "
                                               "loopback mode (see stalwart local status)"}, status=409)
        try:
            cut = parse_cut(network.plan, node, request.query.get("from"))
            pods = kubelet.partition(cut)
        except PlanError as exc:
            return web.json_response({"error": str(exc)}, status=404 if str(exc).startswith("node:") else 400)
        except OSError as exc:
            return web.json_response({"error": str(exc)}, status=500)
        return web.json_response({"node": node, "cut_from": cut.describe(), "pods": pods})

    async def heal(request: web.Request) -> web.Response:
        node = request.match_info["node"]
        try:
            cut = kubelet.heal(node)
        except KeyError as exc:
            return web.json_response({"error": str(exc.args[0])}, status=404)
        except LookupError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        try:
            controller.tick()
        except Exception:
            log.exception("node lifecycle controller failed")
        return web.json_response({"node": node, "was_cut_from": cut.describe()})

    app.router.add_post("/stalwart/nodes/{node}/lose", lose)
    app.router.add_post("/stalwart/nodes/{node}/restore", restore)
    app.router.add_get("/stalwart/nodes", nodes)
    app.router.add_post("/stalwart/nodes/{node}/partition", partition)
    app.router.add_post("/stalwart/nodes/{node}/heal", heal)


async def _node_clock(kubelet: ProcessKubelet, controller: NodeLifecycleController) -> None:
    """Kubelet heartbeats, then the node lifecycle controller's look, in one loop: both live in this process, so
    a stall of the process delays both alike instead of reading as lost heartbeats."""
    while True:
        kubelet.node_agents.heartbeat()
        try:
            wait = controller.tick()
        except Exception:
            log.exception("node lifecycle controller failed")
            wait = controller.settings.node_monitor_period
        await asyncio.sleep(wait)


async def serve(directory: Path, *, nodes: int, port: int, with_etcd: bool, stop: asyncio.Event,
                settings: LocalClusterSettings | None = None) -> None:
    settings = settings or LocalClusterSettings()
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    # Every `up` is a fresh cluster: API objects live in memory, so etcd data and pod directories of an
    # earlier run would only describe things that no longer exist.
    for stale in ("etcd", "pods", "pki"):
        await asyncio.to_thread(shutil.rmtree, directory / stale, True)
    names = [f"local-{i}" for i in range(nodes)]
    network, network_info = await make_network(directory, names, settings)
    api_host = network.plan.api_ip if network else "127.0.0.1"
    etcd: EtcdServer | None = None
    try:
        if with_etcd:
            etcd = EtcdServer(directory / "etcd", host=network.plan.etcd_ip if network else "127.0.0.1")
            await asyncio.to_thread(etcd.start, 90.0)  # generous: CI machines may be heavily loaded
        await _serve(directory, names, port, api_host, etcd, network, network_info, stop, settings)
    finally:
        if etcd is not None:
            await asyncio.to_thread(etcd.stop)
        if network is not None:
            await asyncio.to_thread(network.remove)


async def make_network(directory: Path, names: list[str],
                        settings: LocalClusterSettings) -> tuple[NodeNetwork | None, dict[str, Any]]:
    """The network per node the settings ask for, and what ``state.json`` says of it."""
    if settings.network == "loopback":
        return None, {"mode": "loopback", "reason": "asked for (network: loopback)"}
    try:
        network = await asyncio.to_thread(NodeNetwork.create, directory, names)
    except NetworkUnavailable as exc:
        if settings.network == "netns":
            raise
        log.warning("no network per node (%s): every pod gets a loopback address", exc)
        return None, {"mode": "loopback", "reason": str(exc)}
    plan = network.plan
    return network, {"mode": "netns", "subnet": plan.subnet, "bridge": plan.bridge, "bridge_ip": plan.bridge_ip,
                     "api_ip": plan.api_ip,
                     "etcd_ip": plan.etcd_ip, "namespaces": {n: plan.netns(n) for n in names}}


async def _serve(directory: Path, names: list[str], port: int, api_host: str,  # noqa: PLR0917
                 etcd: EtcdServer | None, network: NodeNetwork | None, network_info: dict[str, Any],
                 stop: asyncio.Event, settings: LocalClusterSettings) -> None:
    port = port or free_port(api_host)
    extra = (api_host,) if network else ()
    pki = await asyncio.to_thread(create_pki, directory / "pki", extra)
    store = ObjectStore()
    store.admission.append(default_toleration_seconds(settings.default_not_ready_toleration_seconds,
                                                      settings.default_unreachable_toleration_seconds))
    security = new_security(store)
    kubelet = ProcessKubelet(store, directory, names, api_port=port, settings=settings, network=network)
    controllers = Controllers(store)
    collector = GarbageCollector(store)
    scheduler = Scheduler(store)
    node_controller = NodeLifecycleController(store, settings)
    clock: asyncio.Task[None] | None = None
    server = ApiServer(store, security, kubelet)
    _add_admin_routes(server.app, kubelet, node_controller)
    runner = web.AppRunner(server.app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, api_host, port, ssl_context=pki.server_context())
    try:
        await site.start()
        kubelet.start()
        scheduler.start()
        controllers.start()
        collector.start()
        clock = asyncio.get_running_loop().create_task(_node_clock(kubelet, node_controller))
        api_url = f"https://{api_host}:{port}"
        config = directory / KUBECONFIG_FILE
        config.touch(mode=0o600)
        config.write_text(yaml.safe_dump(kubeconfig(api_url, security.authenticator.admin_token,
                                                    pki.ca.read_bytes())))
        state = {"pid": os.getpid(), "api_url": api_url, "etcd_endpoint": etcd.endpoint if etcd else None,
                 "etcd_pid": etcd.process.pid if etcd and etcd.process else None,
                 "nodes": list(kubelet.nodes), "kubeconfig": str(directory / KUBECONFIG_FILE),
                 "settings": settings.model_dump(), "network": network_info}
        tmp = directory / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(directory / STATE_FILE)
        log.info("local cluster serving at %s (etcd %s)", api_url, state["etcd_endpoint"])
        await stop.wait()
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            if json.loads((directory / STATE_FILE).read_text())["pid"] == os.getpid():
                (directory / STATE_FILE).unlink()
        if clock is not None:
            clock.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await clock
        await controllers.stop()
        await scheduler.stop()
        await collector.stop()
        await kubelet.shutdown()
        await runner.cleanup()


async def _watch_owner(pid: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("owner process %d is gone: shutting down", pid)
            stop.set()
            return
        except PermissionError:
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stalwart.local.controlplane")
    parser.add_argument("--dir", required=True, type=Path, help="state directory")
    parser.add_argument("--nodes", type=int, default=3, help="number of virtual nodes (default 3)")
    parser.add_argument("--port", type=int, default=0, help="API port (default: a free one)")
    parser.add_argument("--no-etcd", action="store_true", help="do not start etcd")
    parser.add_argument("--settings", default="{}",
                        help="LocalClusterSettings as JSON (node capacity, node-loss timings)")
    parser.add_argument("--owner-pid", type=int, default=0,
                        help="shut down when this process is gone (a test session that was killed)")
    args = parser.parse_args(argv)
    try:
        settings = LocalClusterSettings.model_validate_json(args.settings)
    except ValidationError as exc:
        parser.error(f"--settings: {exc}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watcher = loop.create_task(_watch_owner(args.owner_pid, stop)) if args.owner_pid > 1 else None
        await serve(args.dir, nodes=args.nodes, port=args.port, with_etcd=not args.no_etcd, stop=stop,
                    settings=settings)
        if watcher is not None:
            watcher.cancel()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
