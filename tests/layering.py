"""The import-rule checker behind tests/test_layers.py: reads every module of a ``stalwart/`` tree with ``ast``
(imports at module level, inside functions and under ``TYPE_CHECKING`` alike) and reports each import that
breaks a rule. The rules themselves are data, in tests/test_layers.py.

A *unit* is what the rules speak of: a top-level package or module of ``stalwart`` (``agent``, ``api``,
``demo``, ``net``...), or ``stalwart`` itself for the package's ``__init__``. Imports inside one unit are never
checked; imports of third-party code are checked only against rules that name libraries.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT_UNIT = "stalwart"
EVERY_UNIT = "*"


@dataclass(frozen=True)
class Rule:
    """``importers`` (units, or ``*`` for every unit but those in ``exempt``) never import ``forbidden`` (units,
    ``*`` for every other unit) nor the third-party ``libraries`` (top-level module names)."""

    name: str
    why: str
    importers: tuple[str, ...]
    forbidden: tuple[str, ...] = ()
    libraries: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()

    def covers(self, unit: str) -> bool:
        return unit not in self.exempt and (EVERY_UNIT in self.importers or unit in self.importers)

    def forbids(self, imp: Import) -> bool:
        if not self.covers(imp.unit):
            return False
        if imp.target_unit is None:
            return imp.target.split(".")[0] in self.libraries
        return imp.target_unit != imp.unit and (EVERY_UNIT in self.forbidden or imp.target_unit in self.forbidden)


@dataclass(frozen=True)
class Import:
    """One imported module or name: ``target`` is its absolute dotted name; ``target_unit`` is None for code
    outside ``stalwart``."""

    path: str
    line: int
    module: str
    unit: str
    target: str
    target_unit: str | None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.module}) imports {self.target}"


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str
    imports: tuple[Import, ...] = field(default=())

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_UNIT


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _exists(root: Path, dotted: str) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(root: Path, path: Path) -> Iterator[Import]:
    """Every import in the file at ``path`` (under ``root``), each imported name of a ``from`` import apart:
    ``from stalwart import local`` imports the module stalwart.local, ``from stalwart.x import y`` the name."""
    module = module_name(root, path)
    rel = path.relative_to(root).as_posix()
    unit = unit_of(module)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path.name == "__init__.py", node)
            for alias in node.names:
                dotted = f"{base}.{alias.name}" if alias.name != "*" else base
                ours = base == ROOT_UNIT or base.startswith(ROOT_UNIT + ".")
                # A submodule imported by name is an import of that module; any other name belongs to `base`.
                targets.append(dotted if alias.name != "*" and (not ours or _exists(root, dotted)
                                                                 or alias.name.startswith("_")) else base)
        for target in dict.fromkeys(targets):  # names from one module: one import of it
            ours = target == ROOT_UNIT or target.startswith(ROOT_UNIT + ".")
            yield Import(rel, node.lineno, module, unit, target, unit_of(target) if ours else None)


def collect(root: Path) -> list[Import]:
    """The imports of every module under ``root/stalwart``."""
    return [imp for path in sorted((root / ROOT_UNIT).rglob("*.py")) for imp in imports_of(root, path)]


def units(root: Path) -> set[str]:
    found = {ROOT_UNIT} if (root / ROOT_UNIT / "__init__.py").is_file() else set()
    for child in (root / ROOT_UNIT).iterdir():
        if child.suffix == ".py" and child.name != "__init__.py":
            found.add(child.stem)
        elif (child / "__init__.py").is_file():
            found.add(child.name)
    return found


def _private(imp: Import) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in imp.target.split(".")[1:])


def _cycles(edges: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


@dataclass(frozen=True)
class Report:
    violations: list[Violation]
    unused_allowances: list[tuple[str, str]]

    def lines(self) -> list[str]:
        out = [str(v) for v in self.violations]
        out += [f"[pending-allowance-unused] {m} -> {u} no longer breaks a rule: remove it from PENDING"
                for m, u in self.unused_allowances]
        return out


def check(root: Path, rules: Iterable[Rule], places: Iterable[str],
          allowed: Iterable[tuple[str, str]] = ()) -> Report:
    """Every rule broken by the tree under ``root``. ``places``: the units the layering knows (a new unit must
    be given a place first). ``allowed``: (importing module, imported unit) pairs exempt from every rule, each
    of which must still be needed."""
    rules = list(rules)
    allowed = set(allowed)
    used: set[tuple[str, str]] = set()
    violations: list[Violation] = []
    known = set(places)
    for unit in sorted(units(root) - known):
        violations.append(Violation("every-unit-placed", f"stalwart/{unit} has no place in the layering: add it "
                                                         "to PLACES with where it runs, and to docs/design.md"))
    edges: dict[str, dict[str, list[Import]]] = {}
    for imp in collect(root):
        pair = (imp.module, imp.target_unit or imp.target.split(".")[0])
        broken = [r for r in rules if r.forbids(imp)]
        if imp.target_unit is not None and imp.target_unit != imp.unit and _private(imp):
            broken.append(Rule("public-names-only", "across units only public names are imported", ("*",)))
        if broken and pair in allowed:
            used.add(pair)
            continue
        violations += [Violation(r.name, f"{imp.where}: {r.why}", (imp,)) for r in broken]
        if imp.target_unit is not None and imp.target_unit != imp.unit:
            edges.setdefault(imp.unit, {}).setdefault(imp.target_unit, []).append(imp)
    for component in _cycles(edges):
        members = set(component)
        through = [i for u in component for t, imps in edges[u].items() if t in members for i in imps[:1]]
        violations.append(Violation(
            "no-unit-cycles", f"units {' <-> '.join(component)} import each other: "
                              + "; ".join(i.where for i in through), tuple(through)))
    return Report(violations, sorted(allowed - used))
