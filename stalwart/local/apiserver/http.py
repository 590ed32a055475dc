"""The HTTP face of the emulator: kube-apiserver's URL layout over :class:`~.objects.ObjectStore`.

Every request is authenticated and authorized first (:mod:`.security`; 401 and 403 as the API server answers
them). Answers in JSON only (every client used here asks for JSON or accepts it as an alternative) and reads JSON,
YAML (apply patches) and the protobuf bodies of :mod:`.protobuf`; serves legacy discovery (clients fall back to it
from aggregated discovery), OpenAPI (:mod:`.openapi`), list (with label and field selectors, ``limit`` and
``continue``, ``resourceVersion``/``resourceVersionMatch=Exact``), get, watch (:mod:`.watching`), Table output,
create/update/patch/delete/deletecollection, the status, scale, finalize and token subresources, the review
resources (:mod:`.reviews`), ``pods/log`` and ``pods/binding``/``eviction`` through the kubelet hooks, and
``dryRun=All``. Writes are owned by their ``fieldManager``, else by the client's user agent, as on a real API.
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

from stalwart.local.apiserver import openapi, podlife, protobuf, tables
from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError, bad_request, conflict, not_found
from stalwart.local.apiserver.objects import ObjectStore, WriteOptions
from stalwart.local.apiserver.requestinfo import RequestInfo, request_info
from stalwart.local.apiserver.reviews import REVIEWS, review, token_request
from stalwart.local.apiserver.security import Security
from stalwart.local.apiserver.selectors import SelectorError, parse_field_selector, parse_label_selector
from stalwart.local.apiserver.watching import serve_watch, wants_table

log = logging.getLogger(__name__)
JSON = dict[str, Any]
MAX_BODY = 3 * 1024 * 1024  # kube-apiserver's request size limit
KUBE_VERSION = {"major": "1", "minor": "37", "gitVersion": "v1.37.0-stalwart.local", "gitCommit": "",
                "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z", "goVersion": "go1.25",
                "compiler": "gc", "platform": "linux/amd64"}
NOT_FOUND = "the server could not find the requested resource"

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
    # A newline ends the body, as Go's JSON encoder ends it (clients compare Status bodies as text).
    resp = web.Response(body=json.dumps(data, separators=(",", ":")).encode() + b"\n", status=status,
                        content_type="application/json")
    for w in warnings or []:
        text = " ".join(w.split()).replace("\\", "\\\\").replace('"', '\\"')
        resp.headers.add("Warning", f'299 - "{text}"')
    return resp


def _error(exc: ApiError) -> web.Response:
    return _json(exc.status(), exc.code)


def _field_manager(request: web.Request) -> str:
    """The ``fieldManager`` parameter, else the user agent's product name (as the API server defaults it)."""
    given = request.query.get("fieldManager")
    if given:
        return given
    return request.headers.get("User-Agent", "").split("/")[0].strip()[:128]


class ApiServer:
    """Builds the aiohttp application. ``kubelet`` is optional (logs answer 400 without it)."""

    def __init__(self, store: ObjectStore, security: Security, kubelet: Kubelet | None = None) -> None:
        self.store = store
        self.security = security
        self.kubelet = kubelet
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors, self._guard])
        r = self.app.router
        for path in ("/healthz", "/readyz", "/livez"):
            r.add_get(path, self._ok)
        r.add_get("/version", lambda _: self._async_json(KUBE_VERSION))
        r.add_get("/version/", lambda _: self._async_json(KUBE_VERSION))
        r.add_get("/openapi/v2", self._openapi_v2)
        r.add_get("/openapi/v3", lambda _: self._async_json(openapi.v3_index(self.store.registry)))
        r.add_get("/openapi/v3/{path:.*}", self._openapi_v3)
        r.add_post("/stalwart/compact", self._compact)
        r.add_get("/stalwart/access", self._access)
        r.add_route("*", "/api", self._dispatch)
        r.add_route("*", "/apis", self._dispatch)
        r.add_route("*", "/api/{rest:.*}", self._dispatch)
        r.add_route("*", "/apis/{rest:.*}", self._dispatch)

    async def _async_json(self, data: Any) -> web.Response:
        return _json(data)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _compact(self, request: web.Request) -> web.Response:
        self.store.compact()
        return _json({"compactedResourceVersion": str(self.store.compacted_rv)})

    async def _access(self, request: web.Request) -> web.Response:
        return _json({"access": self.security.access_records(request.query.get("user"))})

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return _error(exc)
        except SelectorError as exc:
            return _error(bad_request(str(exc)))
        except web.HTTPNotFound:
            return _error(ApiError(404, "NotFound", NOT_FOUND))
        except web.HTTPException:
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("internal error serving %s %s", request.method, request.path)
            return _error(ApiError(500, "InternalError", f"an error on the server ({exc!r}) has prevented the "
                                                         "request from succeeding"))

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        info = request_info(request.method, request.path, request.query)
        request["user"] = self.security.check(request.headers.get("Authorization"), info)
        request["info"] = info
        return await handler(request)

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
            raise ApiError(404, "NotFound", NOT_FOUND)
        return _json(doc)

    # --- routing ---------------------------------------------------------------------------------------------

    def _discovery(self, request: web.Request) -> web.Response:
        parts = [p for p in request.path.split("/") if p]
        registry = self.store.registry
        if parts == ["api"]:
            doc: JSON | None = registry.api_versions()
        elif parts == ["apis"]:
            doc = registry.api_group_list()
        elif parts[0] == "apis" and len(parts) == 2:
            doc = registry.api_group(parts[1])
        else:
            group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
            doc = registry.resource_list(group, version)
        if request.method != "GET":
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")
        if doc is None:
            raise ApiError(404, "NotFound", NOT_FOUND)
        return _json(doc)

    def _options(self, request: web.Request) -> WriteOptions:
        q = request.query
        opts = WriteOptions(dry_run=q.get("dryRun") == "All", field_validation=q.get("fieldValidation", "Warn"),
                            field_manager=_field_manager(request), force=q.get("force") == "true",
                            user=request["user"], authorize=self.security.allowed)
        if opts.field_validation not in ("Ignore", "Warn", "Strict"):
            raise bad_request(f"fieldValidation: invalid value {opts.field_validation!r}: expected Ignore, Warn or "
                              "Strict")
        return opts

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        info: RequestInfo = request["info"]
        if info.discovery:
            return self._discovery(request)
        if not info.resource:
            raise ApiError(404, "NotFound", NOT_FOUND)
        res = self.store.info(info.group, info.version, info.resource)
        namespace = (info.namespace or None) if res.namespaced else None  # None: across all namespaces
        name, sub = info.name or None, info.subresource
        if res.namespaced and namespace is None and name is not None:
            raise ApiError(404, "NotFound", NOT_FOUND)
        if sub and sub not in res.subresources:
            raise ApiError(404, "NotFound", NOT_FOUND)
        ns = namespace or ""
        if request.method == "GET":
            if name is None:
                if info.verb == "watch":
                    labels, fields = self._selectors(request)
                    return await serve_watch(request, self.store, res, namespace, labels, fields)
                return self._list(request, res, namespace)
            if sub == "log":
                return await self._logs(request, ns, name)
            if sub == "scale":
                return _json(self.store.scale_of(res, ns, name))
            obj = self.store.get(res, ns, name)
            if wants_table(request):
                return _json(tables.table([obj], res.group, res.plural, res.crd, str(self.store.rv),
                                          include_object=request.query.get("includeObject", "Metadata")))
            return _json(obj)
        opts = self._options(request)
        if request.method == "POST":
            return await self._post(request, res, ns, name, sub, opts)
        if request.method == "PUT" and name is not None:
            body = await self._body(request)
            if sub == "scale":
                return _json(self._put_scale(res, ns, name, body, opts))
            return _json(self.store.update(res, ns, name, body, sub, opts), 200, opts.warnings)
        if request.method == "PATCH" and name is not None:
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
            ptype = PATCH_TYPES.get(ctype)
            if ptype is None:
                raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                            f"accepted media types include: {', '.join(PATCH_TYPES)}")
            body = await self._body(request, yaml_ok=ptype == "apply")
            existed = self.store.objects.get(self.store.key(res, ns, name)) is not None
            if ptype == "apply" and not request.query.get("fieldManager"):
                opts.field_manager = ""
            obj = self.store.patch(res, ns, name, ptype, body, sub, opts)
            if sub == "scale":
                obj = self.store.scale_of(res, ns, name)
            return _json(obj, 200 if existed else 201, opts.warnings)
        if request.method == "DELETE":
            raw = await request.read()
            options: JSON = (await self._body(request)) if raw.strip() else {}
            q = request.query
            if "gracePeriodSeconds" in q:
                options["gracePeriodSeconds"] = int(q["gracePeriodSeconds"])
            if "propagationPolicy" in q:
                options["propagationPolicy"] = q["propagationPolicy"]
            if name is None:
                return self._delete_collection(request, res, namespace, options, opts.dry_run)
            return _json(self.store.delete(res, ns, name, options, opts.dry_run))
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    async def _post(self, request: web.Request, res: ResourceInfo, ns: str, name: str | None,  # noqa: PLR0917
                    sub: str, opts: WriteOptions) -> web.Response:
        body = await self._body(request)
        if name is None:
            if (res.group, res.plural) in REVIEWS:
                return _json(review(res, self.security, request["user"], ns, body), 201)
            return _json(self.store.create(res, ns, body, opts), 201, opts.warnings)
        if res.plural == "serviceaccounts" and sub == "token":
            return _json(token_request(self.store, self.security.authenticator, ns, name, body), 201)
        if res.plural == "pods" and sub == "binding":
            target = (body.get("target") or {}).get("name")
            if not target:
                raise ApiError(422, "Invalid", "target.name: Required value")
            podlife.bind(self.store, ns, name, str(target))
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)
        if res.plural == "pods" and sub == "eviction":
            self.store.delete(res, ns, name, (body or {}).get("deleteOptions"))
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

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
            raise bad_request(f"the request body is not valid {'YAML' if yaml_ok else 'JSON'}: {exc}") from exc

    def _put_scale(self, info: ResourceInfo, namespace: str, name: str, body: JSON, opts: WriteOptions) -> JSON:
        obj = self.store.get(info, namespace, name)
        given = (body.get("metadata") or {}).get("resourceVersion")
        if given and given != obj["metadata"]["resourceVersion"]:
            raise conflict(info, name, "the object has been modified; please apply your changes to the latest "
                                       "version and try again")
        self.store.patch(info, namespace, name, "merge", {"spec": body.get("spec") or {}}, "scale", opts)
        return self.store.scale_of(info, namespace, name)

    def _selectors(self, request: web.Request) -> tuple[Any, Any]:
        return (parse_label_selector(request.query.get("labelSelector")),
                parse_field_selector(request.query.get("fieldSelector")))

    def _list(self, request: web.Request, info: ResourceInfo, namespace: str | None) -> web.Response:
        labels, fields = self._selectors(request)
        q = request.query
        try:
            limit = int(q.get("limit") or 0)
        except ValueError:
            raise bad_request(f"limit: invalid value {q.get('limit')!r}: expected an integer") from None
        exact = None
        if q.get("resourceVersionMatch") == "Exact" and q.get("resourceVersion"):
            try:
                exact = int(q["resourceVersion"])
            except ValueError:
                raise bad_request(f"invalid resourceVersion {q['resourceVersion']!r}: expected an integer") from None
        page = self.store.list_page(info, namespace, labels, fields, limit=limit, token=q.get("continue", ""),
                                    exact_rv=exact)
        if wants_table(request):
            return _json(tables.table(page.items, info.group, info.plural, info.crd, str(page.rv),
                                      include_object=q.get("includeObject", "Metadata")))
        meta: JSON = {"resourceVersion": str(page.rv)}
        if page.continue_token:
            meta["continue"] = page.continue_token
        if page.remaining is not None:
            meta["remainingItemCount"] = page.remaining
        return _json({"kind": f"{info.kind}List", "apiVersion": info.api_version, "metadata": meta,
                      "items": page.items})

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

    async def _logs(self, request: web.Request, namespace: str, name: str) -> web.StreamResponse:
        info = self.store.info("", "v1", "pods")
        pod = self.store.get(info, namespace, name)
        if self.kubelet is None:
            raise bad_request("no kubelet serves pod logs on this server")
        q = request.query
        containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        container = q.get("container")
        if container is None:
            if len(containers) != 1:
                raise bad_request(f"a container name must be specified for pod {name}, choose one of: "
                                  f"[{' '.join(containers)}]")
            container = containers[0]
        inits = [c["name"] for c in (pod.get("spec") or {}).get("initContainers") or []]
        if container not in containers + inits:
            raise bad_request(f"container {container} is not valid for pod {name}")
        if not (pod.get("spec") or {}).get("nodeName"):
            raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating')
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
