"""Validation of TrainingJob manifests with messages that name the field and say what was expected.

The core is :func:`document_problems` (a parsed document -> its problems) and :func:`text_problems` (YAML
text -> problems of every document in it); both are pure. ``stalwart validate`` reads the files.

Documents are checked the way the API server would see them: ``null`` values are dropped first (the CRD has
no nullable fields, so the server prunes them and applies defaults), then the manifest is validated by the
pydantic models in strict mode, so that ``replicas: "2"`` or ``replicas: 2.5`` is an error here as it is
for the CRD's schema.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import json
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from stalwart.api import naming
from stalwart.api.base import RuleViolation
from stalwart.api.trainingjob import API_VERSION, KIND, TrainingJob

_PATTERN_MEANING = {
    naming.DNS1123_LABEL.pattern:
        "must be a DNS-1123 label: lower case letters, digits and '-', starting and ending alphanumeric",
    naming.DNS1123_SUBDOMAIN.pattern:
        "must be a DNS-1123 subdomain: lower case letters, digits, '-' and '.'",
}


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem of one document: ``source`` (a file name or ``-``), ``document`` (1-based, ``None`` when
    the source holds one document), ``path`` (wire field path, e.g. ``spec.rendezvous.endpoints[0]``;
    empty for the document as a whole) and ``message``."""

    source: str
    document: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = self.source if self.document is None else f"{self.source}#{self.document}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


def format_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """``("spec", "rules", 0, "action")`` -> ``spec.rules[0].action``; odd keys are quoted."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.replace("_", "a").replace("-", "a").isalnum() and not part[:1].isdigit():
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out


def _join(base: str, sub: str) -> str:
    if not sub:
        return base
    if sub.startswith("[") or not base:
        return base + sub
    return f"{base}.{sub}"


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class whose object sits at ``loc`` in a TrainingJob, if any (for spelling suggestions)."""
    model: Any = TrainingJob
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = next((f for name, f in model.model_fields.items() if (f.alias or name) == part), None)
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """The model class inside ``X``, ``X | None``, ``list[X]`` or ``list[X] | None``, else the annotation."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        for inner in typing.get_args(arg):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return annotation


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    parent = _model_at(loc[:-1])
    name = loc[-1]
    if parent is None or not isinstance(name, str):
        return "unknown field"
    known = [f.alias or n for n, f in parent.model_fields.items()]
    lowered = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    # A field name with a word added or dropped ("specification", "inProcessRestart") is close too.
    close = close or [k for k in lowered if name.lower().startswith(k) or k.startswith(name.lower())][:1]
    if close:
        return f"unknown field; did you mean {lowered[close[0]]!r}?"
    return f"unknown field; expected one of: {', '.join(known)}"


def _num(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _message(error: ErrorDetails) -> str:
    kind = error["type"]
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    value = error.get("input")
    got = f", got {_show(value)}"
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return _unknown_field(tuple(error["loc"]))
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected an integer, got {_type_name(value)} {_show(value)}"
    if kind in ("float_type", "float_parsing"):
        return f"expected a number, got {_type_name(value)} {_show(value)}"
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {_type_name(value)} {_show(value)}"
    if kind in ("string_type",):
        return f"expected a string, got {_type_name(value)} {_show(value)}"
    if kind in ("list_type",):
        return f"expected a list, got {_type_name(value)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping, got {_type_name(value)}"
    if kind in ("datetime_type", "datetime_parsing", "datetime_from_date_parsing"):
        return f"expected an RFC 3339 date-time, got {_show(value)}"
    if kind == "greater_than_equal":
        return f"must be greater than or equal to {_num(ctx['ge'])}{got}"
    if kind == "greater_than":
        return f"must be greater than {_num(ctx['gt'])}{got}"
    if kind == "less_than_equal":
        return f"must be less than or equal to {_num(ctx['le'])}{got}"
    if kind == "less_than":
        return f"must be less than {_num(ctx['lt'])}{got}"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return f"must have at least {n} item{'s' if n != 1 else ''}, got {ctx.get('actual_length', 0)}"
    if kind == "too_long":
        return f"must have at most {ctx.get('max_length')} items, got {ctx.get('actual_length')}"
    if kind == "string_too_short":
        return "must not be empty" if ctx.get("min_length") == 1 else \
            f"must be at least {ctx.get('min_length')} characters{got}"
    if kind == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters, got {len(str(value))}"
    if kind == "string_pattern_mismatch":
        meaning = _PATTERN_MEANING.get(str(ctx.get("pattern")), f"must match {ctx.get('pattern')}")
        return f"{meaning}{got}"
    if kind in ("enum", "literal_error"):
        return f"expected {ctx.get('expected')}{got}"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return f"{error['msg']}{got}"


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    # YAML turns unquoted timestamps into datetimes; the API server keeps them as RFC 3339 strings.
    if isinstance(value, _dt.datetime | _dt.date):
        return value.isoformat().replace("+00:00", "Z")
    return str(value)


def document_problems(document: Any) -> list[tuple[str, str]]:
    """The problems of one parsed manifest as ``(path, message)``; empty when it is a valid TrainingJob."""
    if not isinstance(document, dict):
        return [("", f"expected a Kubernetes object (a mapping), got {_type_name(document)}")]
    document = _drop_nulls(document)
    kind, api_version = document.get("kind"), document.get("apiVersion")
    if kind != KIND:
        found = "kind is missing" if kind is None else f"got {_show(kind)}"
        return [("kind", f"expected {KIND!r}, {found}")]
    if api_version != API_VERSION:
        found = "apiVersion is missing" if api_version is None else f"got {_show(api_version)}"
        return [("apiVersion", f"expected {API_VERSION!r}, {found}")]
    try:
        TrainingJob.model_validate_json(json.dumps(document, default=_json_default), strict=True)
    except ValidationError as exc:
        problems = _problems(exc)
        return problems + _rules_not_reached(document, problems)
    return []


def _model_nodes(model: type[BaseModel], raw: Any, loc: tuple[int | str, ...] = ()
                 ) -> Iterator[tuple[type[BaseModel], dict[str, Any], tuple[int | str, ...]]]:
    """Every (model class, raw mapping, location) of the document, the root first."""
    if not isinstance(raw, dict):
        return
    yield model, raw, loc
    for name, field in model.model_fields.items():
        alias = field.alias or name
        inner = _unwrap(field.annotation)
        if alias not in raw or not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            continue
        value = raw[alias]
        if isinstance(value, list):
            for index, item in enumerate(value):
                yield from _model_nodes(inner, item, (*loc, alias, index))
        else:
            yield from _model_nodes(inner, value, (*loc, alias))


_CEL_FIELD = re.compile(r"\bself\.([A-Za-z_][A-Za-z0-9_]*)")


def _rules_not_reached(document: dict[str, Any], problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Cross-field rules of objects that pydantic did not check because a field inside them is invalid.

    Such a rule is still evaluated, on the object built without validation, unless a field it reads or
    reports on already has a problem or it cannot be evaluated on unvalidated values; so one run shows a
    user every problem it can.
    """
    out: list[tuple[str, str]] = []
    paths = {path for path, _ in problems}
    for model, raw, loc in _model_nodes(TrainingJob, document):
        rules = getattr(model, "__rules__", [])
        base = format_path(loc)
        inside = [p for p in paths if p != base and p.startswith(base) and (not base or p[len(base)] in ".[")]
        if not rules or not inside:
            continue
        try:
            known = {(f.alias or n): n for n, f in model.model_fields.items()}
            unvalidated = model.model_construct(**{known[k]: v for k, v in raw.items() if k in known})
        except Exception:
            continue
        for rule in rules:
            # The fields a rule reads are the ones its CEL form names; a problem in any of them (or in
            # the field it reports on) has been reported already, and the rule would only echo it.
            touched = {_join(base, name) for name in _CEL_FIELD.findall(rule.cel)} | {_join(base, rule.field)}
            if any(p == t or p.startswith(t + ".") or p.startswith(t + "[") for p in paths for t in touched):
                continue
            try:
                message = rule.check(unvalidated)
            except Exception:
                continue
            if message is not None:
                out.append((_join(base, rule.field), message))
    return out


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for error in exc.errors():
        path = format_path(tuple(error["loc"]))
        cause = (error.get("ctx") or {}).get("error")
        if error["type"] == "value_error" and isinstance(cause, RuleViolation):
            out.extend((_join(path, sub), message) for sub, message in cause.problems)
        else:
            out.append((path, _message(error)))
    return out


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (a silent source of wrong settings) with their position."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, list | dict):
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, "found an unhashable key", key_node.start_mark)
        if key in seen:
            first = seen[key].start_mark
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {key!r} (first at line {first.line + 1})", key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_documents(text: str) -> tuple[list[Any], str | None]:
    """Parse multi-document YAML: the documents (empty ones skipped) and the syntax error, if any, as
    ``line L, column C: message`` (1-based). Documents before an error are returned."""
    documents: list[Any] = []
    try:
        for document in yaml.load_all(text, Loader=_StrictLoader):
            if document is not None:
                documents.append(document)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        return documents, f"{where}malformed YAML: {what}"
    except yaml.YAMLError as exc:
        return documents, f"malformed YAML: {exc}"
    return documents, None


def text_problems(source: str, text: str) -> tuple[int, list[Problem]]:
    """Validate every document of YAML ``text`` read from ``source``: (number of documents, problems)."""
    documents, syntax_error = load_documents(text)
    problems: list[Problem] = []
    numbered = len(documents) > 1 or (syntax_error is not None and len(documents) > 0)
    for index, document in enumerate(documents, start=1):
        for path, message in document_problems(document):
            problems.append(Problem(source, index if numbered else None, path, message))
    if syntax_error is not None:
        problems.append(Problem(source, None, "", syntax_error))
    elif not documents:
        problems.append(Problem(source, None, "", "no documents: expected a TrainingJob manifest"))
    return len(documents), problems
