"""The HTTP face of the emulator: kube-apiserver's URL layout over :class:`~.objects.ObjectStore`.

Answers in JSON only (every client used here asks for JSON or accepts it as an alternative) and reads JSON,
YAML (apply patches) and the protobuf bodies of :mod:`.protobuf`; serves legacy discovery
(clients fall back to it from aggregated discovery), OpenAPI (:mod:`.openapi`), list/get/watch (with label and
field selectors, ``resourceVersion``, ``timeoutSeconds``, bookmarks and ``sendInitialEvents``), Table output,
create/update/patch/delete/deletecollection, the status and scale subresources, ``pods/log`` and
``pods/binding``/``eviction`` through the kubelet hooks, and ``dryRun=All``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import yaml
from aiohttp import web

from stalwart.local.apiserver import openapi, protobuf, tables
from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.objects import ApiError, Event, ObjectStore, WriteOptions, not_found
from stalwart.local.apiserver.selectors import SelectorError, parse_field_selector, parse_label_selector

log = logging.getLogger(__name__)
JSON = dict[str, Any]
MAX_BODY = 3 * 1024 * 1024  # kube-apiserver's request size limit
BOOKMARK_EVERY = 10.0
KUBE_VERSION = {"major": "1", "minor": "37", "gitVersion": "v1.37.0-stalwart.local", "gitCommit": "",
                "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z", "goVersion": "go1.25",
                "compiler": "gc", "platform": "linux/amd64"}

PATCH_TYPES = {
    "application/json-patch+json": "json",
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/apply-patch+yaml": "apply",
    "application/apply-patch+json": "apply",
}


class Kubelet(Protocol):
    """What the HTTP layer asks of the kubelet (pod logs)."""

    def logs(self, namespace: str, name: str, container: str | None, *, follow: bool, tail_lines: int | None,
             previous: bool, limit_bytes: int | None) -> AsyncIterator[bytes]: ...


def _json(data: Any, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    resp = web.Response(body=json.dumps(data, separators=(",", ":")).encode(), status=status,
                        content_type="application/json")
    for w in warnings or []:
        text = " ".join(w.split()).replace("\\", "\\\\").replace('"', '\\"')
        resp.headers.add("Warning", f'299 - "{text}"')
    return resp


def _error(exc: ApiError) -> web.Response:
    return _json(exc.status(), exc.code)


def _wants_table(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return "as=Table" in accept


class ApiServer:
    """Builds the aiohttp application. ``kubelet`` is optional (logs answer 400 without it)."""

    def __init__(self, store: ObjectStore, kubelet: Kubelet | None = None) -> None:
        self.store = store
        self.kubelet = kubelet
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors])
        r = self.app.router
        for path in ("/healthz", "/readyz", "/livez"):
            r.add_get(path, self._ok)
        r.add_get("/version", lambda _: self._async_json(KUBE_VERSION))
        r.add_get("/version/", lambda _: self._async_json(KUBE_VERSION))
        r.add_get("/api", lambda _: self._async_json(self.store.registry.api_versions()))
        r.add_get("/apis", lambda _: self._async_json(self.store.registry.api_group_list()))
        r.add_get("/openapi/v2", self._openapi_v2)
        r.add_get("/openapi/v3", lambda _: self._async_json(openapi.v3_index(self.store.registry)))
        r.add_get("/openapi/v3/{path:.*}", self._openapi_v3)
        r.add_post("/stalwart/compact", self._compact)
        r.add_route("*", "/api/{rest:.*}", self._dispatch)
        r.add_route("*", "/apis/{rest:.*}", self._dispatch)

    async def _async_json(self, data: Any) -> web.Response:
        return _json(data)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _compact(self, request: web.Request) -> web.Response:
        self.store.compact()
        return _json({"compactedResourceVersion": str(self.store.compacted_rv)})

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return _error(exc)
        except SelectorError as exc:
            return _error(ApiError(400, "BadRequest", str(exc)))
        except web.HTTPNotFound:
            return _error(ApiError(404, "NotFound", "the server could not find the requested resource"))
        except web.HTTPException:
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("internal error serving %s %s", request.method, request.path)
            return _error(ApiError(500, "InternalError", f"an error on the server ({exc!r}) has prevented the "
                                                         "request from succeeding"))

    async def _openapi_v2(self, request: web.Request) -> web.Response:
        if "protobuf" in request.headers.get("Accept", ""):
            return web.Response(body=b"", content_type="application/com.github.proto-openapi.spec.v2.v1.0+protobuf")
        return _json({"swagger": "2.0", "info": {"title": "Kubernetes", "version": "v1.37.0"}, "paths": {},
                      "definitions": {}})

    async def _openapi_v3(self, request: web.Request) -> web.Response:
        parts = request.match_info["path"].strip("/").split("/")
        doc = None
        if len(parts) == 2 and parts[0] == "api":
            doc = openapi.group_version_document(self.store.registry, "", parts[1])
        elif len(parts) == 3 and parts[0] == "apis":
            doc = openapi.group_version_document(self.store.registry, parts[1], parts[2])
        if doc is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return _json(doc)

    # --- routing ---------------------------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        if parts[0] == "api":
            if len(parts) == 1:
                return _json(self.store.registry.api_versions())
            group, version, rest = "", parts[1], parts[2:]
        else:
            if len(parts) == 1:
                return _json(self.store.registry.api_group_list())
            group = parts[1]
            if len(parts) == 2:
                doc = self.store.registry.api_group(group)
                if doc is None:
                    raise ApiError(404, "NotFound", "the server could not find the requested resource")
                return _json(doc)
            version, rest = parts[2], parts[3:]
        if not rest:
            if request.method != "GET":
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")
            doc = self.store.registry.resource_list(group, version)
            if doc is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return _json(doc)
        watch_path = False
        if rest[0] == "watch":
            watch_path, rest = True, rest[1:]
        namespace: str | None = None
        if rest and rest[0] == "namespaces" and len(rest) >= 3 and not (len(rest) == 3 and rest[2] in (
                "status", "finalize")):
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        info = self.store.info(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else ""
        if info.namespaced and namespace is None and name is not None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub and sub not in info.subresources and not (info.plural == "namespaces" and sub == "finalize"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        q = request.query
        if request.method == "GET":
            if name is None:
                if watch_path or q.get("watch") in ("true", "1"):
                    return await self._watch(request, info, namespace)
                return self._list(request, info, namespace)
            if sub == "log":
                return await self._logs(request, namespace or "", name)
            if sub == "scale":
                return _json(self.store.scale_of(info, namespace or "", name))
            obj = self.store.get(info, namespace or "", name)
            if _wants_table(request):
                return _json(tables.table([obj], info.group, info.plural, info.crd, str(self.store.rv),
                                          include_object=q.get("includeObject", "Metadata")))
            return _json(obj)
        opts = WriteOptions(dry_run=q.get("dryRun") == "All", field_validation=q.get("fieldValidation", "Warn"),
                            field_manager=q.get("fieldManager", ""))
        if opts.field_validation not in ("Ignore", "Warn", "Strict"):
            raise ApiError(400, "BadRequest", f"fieldValidation: invalid value {opts.field_validation!r}: "
                                              "expected Ignore, Warn or Strict")
        if request.method == "POST":
            body = await self._body(request)
            if name is None:
                return _json(self.store.create(info, namespace or "", body, opts), 201, opts.warnings)
            if info.plural == "pods" and sub == "binding":
                return _json(self._bind(namespace or "", name, body), 201)
            if info.plural == "pods" and sub == "eviction":
                self.store.delete(info, namespace or "", name, (body or {}).get("deleteOptions"))
                return _json({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}, 201)
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested "
                                                    "resource")
        if request.method == "PUT" and name is not None:
            body = await self._body(request)
            sub_name = "" if sub == "finalize" else sub
            if sub == "scale":
                return _json(self._put_scale(info, namespace or "", name, body, opts))
            return _json(self.store.update(info, namespace or "", name, body, sub_name, opts), 200, opts.warnings)
        if request.method == "PATCH" and name is not None:
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
            ptype = PATCH_TYPES.get(ctype)
            if ptype is None:
                raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                            f"accepted media types include: "
                                                            f"{', '.join(PATCH_TYPES)}")
            body = await self._body(request, yaml_ok=ptype == "apply")
            existed = self._exists(info, namespace or "", name)
            obj = self.store.patch(info, namespace or "", name, ptype, body, sub, opts,
                                   force=q.get("force") == "true")
            if sub == "scale":
                obj = self.store.scale_of(info, namespace or "", name)
            return _json(obj, 200 if existed else 201, opts.warnings)
        if request.method == "DELETE":
            raw = await request.read()
            options: JSON = (await self._body(request)) if raw.strip() else {}
            if "gracePeriodSeconds" in q:
                options["gracePeriodSeconds"] = int(q["gracePeriodSeconds"])
            if "propagationPolicy" in q:
                options["propagationPolicy"] = q["propagationPolicy"]
            if name is None:
                return self._delete_collection(request, info, namespace, options, opts.dry_run)
            return _json(self.store.delete(info, namespace or "", name, options, opts.dry_run))
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    def _exists(self, info: ResourceInfo, namespace: str, name: str) -> bool:
        try:
            self.store.get(info, namespace, name)
            return True
        except ApiError:
            return False

    async def _body(self, request: web.Request, yaml_ok: bool = False) -> Any:
        raw = await request.read()
        if request.headers.get("Content-Type", "").startswith(protobuf.CONTENT_TYPE):
            try:
                return protobuf.decode(raw)
            except (protobuf.ProtobufError, UnicodeDecodeError) as exc:
                raise ApiError(415, "UnsupportedMediaType", str(exc)) from exc
        try:
            return yaml.safe_load(raw) if yaml_ok else json.loads(raw or b"{}")
        except (ValueError, yaml.YAMLError) as exc:
            raise ApiError(400, "BadRequest", f"the request body is not valid {'YAML' if yaml_ok else 'JSON'}: "
                                              f"{exc}") from exc

    def _put_scale(self, info: ResourceInfo, namespace: str, name: str, body: JSON, opts: WriteOptions) -> JSON:
        obj = self.store.get(info, namespace, name)
        given = (body.get("metadata") or {}).get("resourceVersion")
        if given and given != obj["metadata"]["resourceVersion"]:
            from stalwart.local.apiserver.objects import conflict

            raise conflict(info, name, "the object has been modified; please apply your changes to the latest "
                                       "version and try again")
        self.store.patch(info, namespace, name, "merge", {"spec": body.get("spec") or {}}, "scale", opts)
        return self.store.scale_of(info, namespace, name)

    def _bind(self, namespace: str, name: str, binding: JSON) -> JSON:
        info = self.store.info("", "v1", "pods")
        target = (binding.get("target") or {}).get("name")
        if not target:
            raise ApiError(422, "Invalid", "target.name: Required value")
        pod = self.store.get(info, namespace, name)
        if (pod.get("spec") or {}).get("nodeName"):
            raise ApiError(409, "Conflict", f'pod {name} is already assigned to node '
                                            f'"{pod["spec"]["nodeName"]}"')
        pod["spec"]["nodeName"] = target
        self.store.update(info, namespace, name, pod)
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    def _selectors(self, request: web.Request) -> tuple[Any, Any]:
        return (parse_label_selector(request.query.get("labelSelector")),
                parse_field_selector(request.query.get("fieldSelector")))

    def _list(self, request: web.Request, info: ResourceInfo, namespace: str | None) -> web.Response:
        labels, fields = self._selectors(request)
        items, rv = self.store.list_objects(info, namespace, labels, fields)
        if _wants_table(request):
            return _json(tables.table(items, info.group, info.plural, info.crd, rv,
                                      include_object=request.query.get("includeObject", "Metadata")))
        return _json({"kind": f"{info.kind}List", "apiVersion": info.api_version,
                      "metadata": {"resourceVersion": rv}, "items": items})

    def _delete_collection(self, request: web.Request, info: ResourceInfo, namespace: str | None,
                           options: JSON, dry_run: bool) -> web.Response:
        labels, fields = self._selectors(request)
        items, _ = self.store.list_objects(info, namespace, labels, fields)
        out = []
        for obj in items:
            meta = obj["metadata"]
            with contextlib.suppress(ApiError):
                out.append(self.store.delete(info, meta.get("namespace", ""), meta["name"], options, dry_run))
        return _json({"kind": f"{info.kind}List", "apiVersion": info.api_version,
                      "metadata": {"resourceVersion": str(self.store.rv)}, "items": out})

    async def _watch(self, request: web.Request, info: ResourceInfo, namespace: str | None) -> web.StreamResponse:
        labels, fields = self._selectors(request)
        q = request.query
        table = _wants_table(request)
        initial = q.get("sendInitialEvents") == "true"
        rv = q.get("resourceVersion")
        try:
            watcher = self.store.watch(info, namespace, None if initial else rv, labels, fields)
        except ApiError as exc:
            if exc.code != 410:
                raise
            # A too-old version is reported inside the stream, as the API server does.
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(json.dumps({"type": "ERROR", "object": exc.status()}).encode() + b"\n")
            await resp.write_eof()
            return resp
        timeout = float(q.get("timeoutSeconds") or 1800)
        bookmarks = q.get("allowWatchBookmarks") == "true"
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        include = q.get("includeObject", "Metadata")

        def encode(ev: Event) -> bytes:
            obj = ev.obj
            obj = {**obj, "apiVersion": info.api_version, "kind": info.kind}
            if table:
                obj = tables.table([obj], info.group, info.plural, info.crd, str(ev.rv), include_object=include)
            return json.dumps({"type": ev.type, "object": obj}, separators=(",", ":")).encode() + b"\n"

        def bookmark(annotations: dict[str, str] | None = None) -> bytes:
            meta: JSON = {"resourceVersion": str(self.store.rv)}
            if annotations:
                meta["annotations"] = annotations
            return json.dumps({"type": "BOOKMARK", "object": {"kind": info.kind, "apiVersion": info.api_version,
                                                              "metadata": meta}}).encode() + b"\n"

        try:
            if initial:
                while not watcher.queue.empty():
                    ev = watcher.queue.get_nowait()
                    if ev is not None:
                        await resp.write(encode(ev))
                await resp.write(bookmark({"k8s.io/initial-events-end": "true"}))
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    ev = await asyncio.wait_for(watcher.queue.get(), min(left, BOOKMARK_EVERY))
                except TimeoutError:
                    if bookmarks:
                        await resp.write(bookmark())
                    continue
                if ev is None:
                    break
                await resp.write(encode(ev))
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.unwatch(watcher)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    async def _logs(self, request: web.Request, namespace: str, name: str) -> web.StreamResponse:
        info = self.store.info("", "v1", "pods")
        pod = self.store.get(info, namespace, name)
        if self.kubelet is None:
            raise ApiError(400, "BadRequest", "no kubelet serves pod logs on this server")
        q = request.query
        containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        container = q.get("container")
        if container is None:
            if len(containers) != 1:
                raise ApiError(400, "BadRequest", f"a container name must be specified for pod {name}, choose one "
                                                  f"of: [{' '.join(containers)}]")
            container = containers[0]
        inits = [c["name"] for c in (pod.get("spec") or {}).get("initContainers") or []]
        if container not in containers + inits:
            raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}")
        if not (pod.get("spec") or {}).get("nodeName"):
            raise ApiError(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: '
                                              "ContainerCreating")
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        try:
            async for chunk in self.kubelet.logs(
                    namespace, name, container, follow=q.get("follow") == "true",
                    tail_lines=int(q["tailLines"]) if "tailLines" in q else None,
                    previous=q.get("previous") == "true",
                    limit_bytes=int(q["limitBytes"]) if "limitBytes" in q else None):
                await resp.write(chunk)
        except FileNotFoundError:
            raise not_found(info, name) from None
        except (ConnectionResetError, asyncio.CancelledError):
            return resp
        await resp.write_eof()
        return resp
