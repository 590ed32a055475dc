"""Label and field selectors, parsed and matched as the Kubernetes API documents them.

Label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k``, ``!k``, comma = AND.
Field selectors: ``path=v``, ``path==v``, ``path!=v`` over dotted paths into the object (``metadata.name``,
``status.phase``, ``spec.nodeName``, ``involvedObject.uid``...); a missing field compares as the empty string.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_SET_RE = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:(notin|in)\s*\(([^)]*)\))?\s*$")


class SelectorError(ValueError):
    """A selector string that does not parse; the message names the offending term."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        if self.op == "exists":
            return present
        return not present


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    terms: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    terms.append("".join(cur))
    return [t.strip() for t in terms if t.strip()]


def parse_label_selector(text: str | None) -> list[Requirement]:
    """Parse a label selector string; raise :class:`SelectorError` naming the bad term."""
    if not text:
        return []
    out: list[Requirement] = []
    for term in _split_terms(text):
        for op in ("!=", "==", "="):
            if op in term and "(" not in term:
                key, _, value = term.partition(op)
                out.append(Requirement(key.strip(), "!=" if op == "!=" else "=", (value.strip(),)))
                break
        else:
            m = _SET_RE.match(term)
            if not m:
                raise SelectorError(f"labelSelector: cannot parse term {term!r}")
            neg, key, setop, vals = m.groups()
            if setop:
                if neg:
                    raise SelectorError(f"labelSelector: '!' cannot combine with {setop} in {term!r}")
                values = tuple(v.strip() for v in vals.split(",") if v.strip())
                out.append(Requirement(key, setop, values))
            else:
                out.append(Requirement(key, "!exists" if neg else "exists"))
    return out


def selector_from_label_selector_object(sel: Mapping[str, Any] | None) -> list[Requirement]:
    """Convert a ``metav1.LabelSelector`` object (matchLabels + matchExpressions) to requirements."""
    if not sel:
        return []
    reqs = [Requirement(k, "=", (str(v),)) for k, v in (sel.get("matchLabels") or {}).items()]
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!exists"}
    for expr in sel.get("matchExpressions") or []:
        op = ops.get(str(expr.get("operator")))
        if op is None:
            raise SelectorError(f"matchExpressions.operator: unknown operator {expr.get('operator')!r}")
        reqs.append(Requirement(str(expr.get("key")), op, tuple(str(v) for v in expr.get("values") or ())))
    return reqs


def labels_match(reqs: list[Requirement], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    return all(r.matches(labels) for r in reqs)


@dataclass(frozen=True)
class FieldRequirement:
    path: tuple[str, ...]
    equal: bool
    value: str


def parse_field_selector(text: str | None) -> list[FieldRequirement]:
    """Parse a field selector string; raise :class:`SelectorError` naming the bad term."""
    if not text:
        return []
    out: list[FieldRequirement] = []
    for term in _split_terms(text):
        for op in ("!=", "==", "="):
            if op in term:
                key, _, value = term.partition(op)
                key = key.strip()
                if not key:
                    raise SelectorError(f"fieldSelector: empty field in {term!r}")
                out.append(FieldRequirement(tuple(key.split(".")), op != "!=", value.strip()))
                break
        else:
            raise SelectorError(f"fieldSelector: expected 'field=value' or 'field!=value', got {term!r}")
    return out


def field_value(obj: Mapping[str, Any], path: tuple[str, ...]) -> str:
    cur: Any = obj
    for part in path:
        if not isinstance(cur, Mapping) or part not in cur:
            return ""
        cur = cur[part]
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def fields_match(reqs: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all((field_value(obj, r.path) == r.value) == r.equal for r in reqs)
