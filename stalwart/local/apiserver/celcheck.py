"""Compile-time checks of a CRD's ``x-kubernetes-validations`` rules, as the API server makes them when a CRD is
stored: a rule that does not parse, names an undeclared variable or selects a field its schema does not have is
refused with the compiler's message (``compilation failed: ERROR: <input>:1:COL: ...`` and a caret line).

Syntax is checked by the ``cel-python`` parser (the full CEL grammar); declarations and fields on the tree of
:mod:`.cel` where the rule is inside its subset. Rules outside the subset that parse are stored and reported
as not enforced (:func:`stalwart.local.apiserver.schema.unsupported_rules`).
"""

from __future__ import annotations

from typing import Any

import celpy
from celpy.celparser import CELParseError

from stalwart.local.apiserver.cel import CelError, Node, parse_rule

JSON = dict[str, Any]
_MISSING = object()
#: What a rule at the root sees of ``metadata``.
_ROOT_METADATA: JSON = {"type": "object", "properties": {"name": {"type": "string"},
                                                         "generateName": {"type": "string"}}}


def _error(source: str, offset: int, message: str) -> str:
    caret = "." * offset + "^"
    return f"compilation failed: ERROR: <input>:1:{offset + 1}: {message}\n | {source}\n | {caret}"


def _closed(schema: Any) -> bool:
    """An object schema whose fields are all declared (no additionalProperties, unknown fields pruned)."""
    return (isinstance(schema, dict) and schema.get("type") == "object" and "properties" in schema
            and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"))


def _field_schema(schema: Any, name: str, at_root: bool) -> Any:
    if not isinstance(schema, dict):
        return None
    if at_root and name == "metadata":
        return _ROOT_METADATA
    if at_root and name in ("apiVersion", "kind"):
        return {"type": "string"}
    props = schema.get("properties") or {}
    if name in props:
        return props[name]
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        return extra
    return _MISSING if _closed(schema) else None


class _Checker:
    def __init__(self, source: str, root: JSON, at_root: bool) -> None:
        self.source, self.root, self.at_root = source, root, at_root

    def visit(self, node: Node, scope: dict[str, Any]) -> Any:
        """Check ``node``; return the schema of its value where known (None where not)."""
        kind = node[0]
        if kind == "var":
            if node[1] not in scope:
                raise ValueError(_error(self.source, node[2], f"undeclared reference to '{node[1]}' (in container '')"))
            return scope[node[1]]
        if kind == "field":
            base = self.visit(node[1], scope)
            at_root = node[1][0] == "var" and node[1][1] in ("self", "oldSelf") and self.at_root
            found = _field_schema(base, node[2], at_root)
            if found is _MISSING:
                raise ValueError(_error(self.source, node[3], f"undefined field '{node[2]}'"))
            return found
        if kind == "macro":
            coll = self.visit(node[2], scope)
            item = coll.get("items") if isinstance(coll, dict) and coll.get("type") == "array" else None
            self.visit(node[4], {**scope, node[3]: item})
            return None
        if kind == "call" and node[1] == "has":
            for arg in node[2]:
                self.visit(arg, scope)
            return None
        for child in node[1:]:
            if isinstance(child, tuple):
                self.visit(child, scope)
            elif isinstance(child, list):
                for c in child:
                    if isinstance(c, tuple):
                        self.visit(c, scope)
        return None


def compile_error(source: str, schema: JSON, *, at_root: bool) -> str | None:
    """The compiler's message if ``source`` does not compile as a rule on ``schema``, else None."""
    if ".?" in source or "[?" in source:
        return None  # optional syntax: newer than the parser here; stored unchecked
    try:
        celpy.Environment().compile(source)
    except CELParseError as exc:
        column = max(int(exc.column or 1) - 1, 0)
        return _error(source, column, "Syntax error: unexpected input")
    try:
        tree = parse_rule(source)
    except CelError:
        return None
    try:
        _Checker(source, schema, at_root).visit(tree, {"self": schema, "oldSelf": schema})
    except ValueError as exc:
        return str(exc)
    return None
