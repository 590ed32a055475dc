"""Admission: what happens to an object between a write request and storage, in the API server's order —
decoding (types, unknown fields: :mod:`.core_schema` for built-in kinds, the CRD's structural schema for custom
resources, with defaulting and pruning), validation (metadata rules of :mod:`.metadata`, the semantic checks
of :mod:`.builtins`, a CRD's own checks in :mod:`.crds`), then the OwnerReferencesPermissionEnforcement plugin:
setting ``blockOwnerDeletion`` on an owner reference needs ``update`` on the owner's ``finalizers``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from stalwart.local.apiserver import builtins, core_schema, crds
from stalwart.local.apiserver import schema as schemas
from stalwart.local.apiserver.authorization import Attributes, UserInfo
from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError, forbidden, invalid
from stalwart.local.apiserver.metadata import metadata_problems

if TYPE_CHECKING:
    from stalwart.local.apiserver.objects import ObjectStore

JSON = dict[str, Any]


@dataclass
class WriteOptions:
    """How a write is made: ``user`` None is a component of the control plane writing directly (no admission
    checks of permissions); ``authorize`` answers permission questions for the admission plugins;
    ``field_manager`` owns what the write changes (none: nobody's)."""
    dry_run: bool = False
    field_validation: str = "Strict"  # Ignore | Warn | Strict
    field_manager: str = ""
    force: bool = False
    user: UserInfo | None = None
    authorize: Callable[[Attributes], bool] | None = None
    warnings: list[str] = field(default_factory=list)
    record: bool = True

    @property
    def record_fields(self) -> bool:
        return self.record and bool(self.field_manager)

    def without_record(self) -> WriteOptions:
        """The same options for a write whose fields were already recorded (by an apply); warnings are shared."""
        return replace(self, record=False)


def _cel_metadata(obj: JSON) -> JSON:
    meta = obj.get("metadata") or {}
    return {k: meta[k] for k in ("name", "generateName") if k in meta}


def _custom(info: ResourceInfo, obj: JSON, old: JSON | None, opts: WriteOptions) -> tuple[JSON, list[schemas.Problem]]:
    schema = info.schema or {}
    obj = schemas.apply_defaults(schema, obj)
    pruned, dropped = schemas.prune(schema, obj)
    if dropped and opts.field_validation == "Strict":
        raise ApiError(400, "BadRequest", f'{info.kind} in version "{info.version}" cannot be handled as a '
                                          f"{info.kind}: strict decoding error: "
                                          + ", ".join(f'unknown field "{d}"' for d in dropped))
    if dropped and opts.field_validation == "Warn":
        opts.warnings += [f'unknown field "{d}"' for d in dropped]
    # CEL rules at the root see only metadata.name and metadata.generateName, as on a real API.
    body = {**pruned, "metadata": _cel_metadata(pruned)}
    old_body = {**(old or {}), "metadata": _cel_metadata(old or {})}
    return pruned, schemas.validate(schema, body, old=old_body, has_old=old is not None)


def _owner_references(store: ObjectStore, info: ResourceInfo, obj: JSON, old: JSON | None,
                      opts: WriteOptions) -> None:
    if opts.authorize is None or opts.user is None:
        return
    before = {r.get("uid") for r in (old or {}).get("metadata", {}).get("ownerReferences") or []
              if r.get("blockOwnerDeletion")}
    meta = obj["metadata"]
    for ref in meta.get("ownerReferences") or []:
        if not ref.get("blockOwnerDeletion") or ref.get("uid") in before:
            continue
        owner = store.registry.by_kind(str(ref.get("apiVersion", "")), str(ref.get("kind", "")))
        if owner is None:
            raise forbidden(info.group, info.plural, meta.get("name", ""),
                            f"cannot set blockOwnerDeletion in this case because cannot find RESTMapping for "
                            f"APIVersion {ref.get('apiVersion')} Kind {ref.get('kind')}")
        attrs = Attributes(opts.user, "update", group=owner.group, version=owner.version, resource=owner.plural,
                           subresource="finalizers", namespace=meta.get("namespace", "") if owner.namespaced else "",
                           name=str(ref.get("name", "")))
        if not opts.authorize(attrs):
            raise forbidden(info.group, info.plural, meta.get("name", ""),
                            "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set "
                            "finalizers on: , <nil>")


def admit(store: ObjectStore, info: ResourceInfo, obj: JSON, old: JSON | None, opts: WriteOptions) -> JSON:
    """The object to store for a write of ``obj`` over ``old`` (None: a create), or the error to answer."""
    problems = metadata_problems(info, obj)
    if info.crd is not None:
        obj, found = _custom(info, obj, old, opts)
        problems += found
    else:
        builtins.decode(info, obj)
        found, warnings = core_schema.check(info, obj, opts.field_validation)
        opts.warnings += warnings
        problems += found + builtins.admit(info, obj, old, store.cluster_ips)
    if crds.is_crd(info):
        problems += crds.problems(obj)
        for version in (obj.get("spec") or {}).get("versions") or []:
            root = ((version.get("schema") or {}).get("openAPIV3Schema")) or {}
            for rule in schemas.unsupported_rules(root):
                opts.warnings.append(f"{obj['metadata'].get('name')} {version.get('name')}: x-kubernetes-validations "
                                     f"rule not enforced by the local cluster: {rule}")
    unique = list(dict.fromkeys(problems))
    if unique:
        raise invalid(info, str(obj["metadata"].get("name", "")), unique)
    _owner_references(store, info, obj, old, opts)
    return obj
