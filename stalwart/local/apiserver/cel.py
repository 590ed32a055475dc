"""A subset of CEL, enough for the ``x-kubernetes-validations`` rules CRDs usually carry.

Supported: literals (int, double, string, bool, null, lists), ``self`` and ``oldSelf``, field access ``a.b`` and
indexing ``a[i]``/``a['k']``, ``has(a.b)``, arithmetic ``+ - * / %`` (``/`` truncates on ints), comparisons,
``&& || !``, ``? :``, ``in`` (lists and maps), ``size()`` (function and method), the macros ``all``, ``exists``,
``exists_one``, ``map``, ``filter``, the string methods ``startsWith``, ``endsWith``, ``contains``, ``matches``,
``lowerAscii``, ``upperAscii``, and the conversions ``int``, ``uint``, ``double``, ``string``. Anything else is
rejected by :func:`compile_rule` with :class:`CelError`, so a rule is either evaluated faithfully or reported as
unsupported, never silently misread. Timestamps, durations, optionals and quantities are not supported.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(r"""\s*(?:
    (?P<num>\d+\.\d+(?:[eE][+-]?\d+)?|\d+[uU]?)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<op>\|\||&&|==|!=|<=|>=|[-+*/%!<>?:.,()\[\]])
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
)""", re.VERBOSE)


class CelError(ValueError):
    """A rule outside the supported subset, or one that does not parse."""


class CelEvalError(ValueError):
    """A rule that failed at evaluation (missing field, type mismatch)."""


@dataclass
class _Tok:
    kind: str
    text: str
    pos: int = 0


def _tokenize(src: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pos = 0
    src = src.strip()
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise CelError(f"unexpected character {src[pos]!r} at offset {pos}")
        kind = m.lastgroup or ""
        toks.append(_Tok(kind, m.group(kind), m.start(kind)))
        pos = m.end()
        while pos < len(src) and src[pos].isspace():
            pos += 1
    toks.append(_Tok("eof", "", len(src)))
    return toks


Node = tuple[Any, ...]
_BINARY = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 3, "<=": 3, ">": 3, ">=": 3, "in": 3,
           "+": 4, "-": 4, "*": 5, "/": 5, "%": 5}
_MACROS = {"all", "exists", "exists_one", "map", "filter"}
_METHODS = {"size", "startsWith", "endsWith", "contains", "matches", "lowerAscii", "upperAscii"}
_FUNCS = {"size", "int", "uint", "double", "string", "has"}


class _Parser:
    def __init__(self, src: str) -> None:
        self.toks = _tokenize(src)
        self.i = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self, text: str | None = None) -> _Tok:
        tok = self.toks[self.i]
        if text is not None and tok.text != text:
            raise CelError(f"expected {text!r}, found {tok.text or 'end of rule'!r}")
        self.i += 1
        return tok

    def parse(self) -> Node:
        node = self.expr()
        if self.peek().kind != "eof":
            raise CelError(f"unexpected {self.peek().text!r}")
        return node

    def expr(self) -> Node:
        cond = self.binary(1)
        if self.peek().text == "?":
            self.take("?")
            a = self.expr()
            self.take(":")
            b = self.expr()
            return ("cond", cond, a, b)
        return cond

    def binary(self, level: int) -> Node:
        left = self.unary()
        while True:
            tok = self.peek()
            op = tok.text if tok.kind in ("op", "id") else ""
            prec = _BINARY.get(op)
            if prec is None or prec < level:
                return left
            self.take()
            right = self.binary(prec + 1)
            left = ("bin", op, left, right)

    def unary(self) -> Node:
        if self.peek().text == "!":
            self.take()
            return ("not", self.unary())
        if self.peek().text == "-":
            self.take()
            return ("neg", self.unary())
        return self.postfix(self.primary())

    def args(self) -> list[Node]:
        self.take("(")
        out: list[Node] = []
        while self.peek().text != ")":
            out.append(self.expr())
            if self.peek().text == ",":
                self.take(",")
        self.take(")")
        return out

    def postfix(self, node: Node) -> Node:
        while True:
            t = self.peek().text
            if t == ".":
                self.take()
                name_tok = self.take()
                name = name_tok.text
                if self.peek().text == "(":
                    if name in _MACROS:
                        self.take("(")
                        var = self.take().text
                        self.take(",")
                        body = self.expr()
                        self.take(")")
                        node = ("macro", name, node, var, body)
                    elif name in _METHODS:
                        node = ("method", name, node, self.args())
                    else:
                        raise CelError(f"unsupported method {name}()")
                else:
                    node = ("field", node, name, name_tok.pos)
            elif t == "[":
                self.take()
                idx = self.expr()
                self.take("]")
                node = ("index", node, idx)
            else:
                return node

    def primary(self) -> Node:
        tok = self.take()
        if tok.kind == "num":
            text = tok.text.rstrip("uU")
            return ("lit", float(text) if "." in text else int(text))
        if tok.kind == "str":
            return ("lit", bytes(tok.text[1:-1], "utf-8").decode("unicode_escape"))
        if tok.text == "(":
            node = self.expr()
            self.take(")")
            return node
        if tok.text == "[":
            items: list[Node] = []
            while self.peek().text != "]":
                items.append(self.expr())
                if self.peek().text == ",":
                    self.take(",")
            self.take("]")
            return ("list", items)
        if tok.kind == "id":
            if tok.text in ("true", "false"):
                return ("lit", tok.text == "true")
            if tok.text == "null":
                return ("lit", None)
            if self.peek().text == "(":
                if tok.text not in _FUNCS:
                    raise CelError(f"unsupported function {tok.text}()")
                return ("call", tok.text, self.args())
            return ("var", tok.text, tok.pos)
        raise CelError(f"unexpected {tok.text or 'end of rule'!r}")


class _Missing(Exception):
    pass


def _ev(node: Node, env: dict[str, Any]) -> Any:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "var":
        if node[1] not in env:
            raise CelEvalError(f"undeclared reference to {node[1]!r}")
        return env[node[1]]
    if kind == "list":
        return [_ev(n, env) for n in node[1]]
    if kind == "field":
        base = _ev(node[1], env)
        if not isinstance(base, dict):
            raise CelEvalError(f"cannot select field {node[2]!r} from a non-object")
        if node[2] not in base:
            raise _Missing(node[2])
        return base[node[2]]
    if kind == "index":
        base, idx = _ev(node[1], env), _ev(node[2], env)
        try:
            return base[idx]
        except (KeyError, IndexError, TypeError) as exc:
            raise CelEvalError(f"index {idx!r} is out of range or of the wrong type") from exc
    if kind == "not":
        return not _truth(_ev(node[1], env))
    if kind == "neg":
        return -_ev(node[1], env)
    if kind == "cond":
        return _ev(node[2], env) if _truth(_ev(node[1], env)) else _ev(node[3], env)
    if kind == "bin":
        return _binary(node[1], node[2], node[3], env)
    if kind == "call":
        name, args = node[1], node[2]
        if name == "has":
            if len(args) != 1 or args[0][0] != "field":
                raise CelEvalError("has() takes one field selection, like has(self.spec)")
            base = _ev(args[0][1], env)
            return isinstance(base, dict) and args[0][2] in base
        vals = [_ev(a, env) for a in args]
        if name == "size":
            return len(vals[0])
        if name in ("int", "uint"):
            return int(vals[0])
        if name == "double":
            return float(vals[0])
        return _to_string(vals[0])
    if kind == "method":
        name, target, args = node[1], _ev(node[2], env), [_ev(a, env) for a in node[3]]
        if name == "size":
            return len(target)
        if not isinstance(target, str):
            raise CelEvalError(f"{name}() needs a string")
        if name == "startsWith":
            return target.startswith(args[0])
        if name == "endsWith":
            return target.endswith(args[0])
        if name == "contains":
            return args[0] in target
        if name == "matches":
            return re.search(args[0], target) is not None
        if name == "lowerAscii":
            return target.lower()
        return target.upper()
    if kind == "macro":
        name, coll, var, body = node[1], _ev(node[2], env), node[3], node[4]
        items = list(coll.keys()) if isinstance(coll, dict) else list(coll)

        def run(item: Any) -> Any:
            return _ev(body, {**env, var: item})

        if name == "all":
            return all(_truth(run(x)) for x in items)
        if name == "exists":
            return any(_truth(run(x)) for x in items)
        if name == "exists_one":
            return sum(1 for x in items if _truth(run(x))) == 1
        if name == "map":
            return [run(x) for x in items]
        return [x for x in items if _truth(run(x))]
    raise CelEvalError(f"unknown node {kind}")


def _to_string(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _truth(v: Any) -> bool:
    if not isinstance(v, bool):
        raise CelEvalError(f"expected a bool, got {type(v).__name__}")
    return v


def _binary(op: str, a: Node, b: Node, env: dict[str, Any]) -> Any:
    if op == "&&":
        return _truth(_ev(a, env)) and _truth(_ev(b, env))
    if op == "||":
        return _truth(_ev(a, env)) or _truth(_ev(b, env))
    x, y = _ev(a, env), _ev(b, env)
    if op == "in":
        return x in y
    if op == "==":
        return bool(x == y)
    if op == "!=":
        return bool(x != y)
    try:
        if op == "<":
            return x < y
        if op == "<=":
            return x <= y
        if op == ">":
            return x > y
        if op == ">=":
            return x >= y
        if op == "+":
            return x + y
        if op == "-":
            return x - y
        if op == "*":
            return x * y
        if op == "/":
            if isinstance(x, int) and isinstance(y, int):
                if y == 0:
                    raise CelEvalError("division by zero")
                q = abs(x) // abs(y)
                return q if (x >= 0) == (y >= 0) else -q
            return x / y
        if op == "%":
            if y == 0:
                raise CelEvalError("modulus by zero")
            return int(x - y * int(x / y)) if isinstance(x, int) else x % y
    except TypeError as exc:
        raise CelEvalError(f"no matching overload for {op!r}") from exc
    raise CelEvalError(f"unknown operator {op!r}")


@dataclass(frozen=True)
class Rule:
    source: str
    evaluate: Callable[[dict[str, Any]], Any]
    uses_old_self: bool


def parse_rule(source: str) -> Node:
    """The syntax tree of a rule (tuples; ``var`` and ``field`` nodes end with their offset in the source);
    :class:`CelError` if it is outside the subset."""
    return _Parser(source).parse()


def compile_rule(source: str) -> Rule:
    """Parse a rule; raise :class:`CelError` if it is outside the subset."""
    tree = parse_rule(source)

    def evaluate(env: dict[str, Any]) -> Any:
        try:
            return _ev(tree, env)
        except _Missing as exc:
            raise CelEvalError(f"no such key: {exc.args[0]}") from None

    return Rule(source, evaluate, "oldSelf" in re.findall(r"[A-Za-z_]\w*", source))
