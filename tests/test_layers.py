"""The layering of stalwart/ as a test: where each unit runs (PLACES), what none may import (RULES), and no
import cycles between units. docs/design.md ("Layers") draws the same picture; change both together.
The checker is tests/layering.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from layering import Rule, check, collect

REPO = Path(__file__).resolve().parents[1]

#: Every top-level package or module of stalwart/ and where its code runs.
PLACES = {
    "api": "everywhere: schemas, the pod contract, formats both sides agree on",
    "etcd": "everywhere etcd is used: the one etcd layer (store, key layout, fencing, torch Store)",
    "net": "everywhere: small network helpers that import nothing of ours",
    "procfs": "everywhere: what the kernel says of a process (the agent and the local cluster ask it)",
    "exits": "everywhere: how a process ends within a bound, its streams closed first",
    "jitter": "everywhere: our own random generator (retry jitter, names), not the user's global one",
    "forkserver": "once per pod, in the training command's interpreter: imports torch once, forks the ranks",
    "operator": "the operator pod",
    "agent": "once per pod: rendezvous, supervision of the rank processes, progress, drills, handover",
    "restart": "each rank process: in-process restart",
    "rpc": "each rank process: calls, server, membership",
    "rref": "each rank process: remote references, over rpc's public interface",
    "drill": "a user's machine: `stalwart drill` against a running job",
    "examples": "each rank process: the example training scripts (user code)",
    "local": "a developer's machine: the local cluster",
    "cli": "wherever `stalwart` runs: the command line, which may reach every part",
    "demo": "a developer's machine: `stalwart demo` on the local cluster",
    "__main__": "`python -m stalwart`",
    "stalwart": "the package's own __init__: the public names for training code",
}

RANK = ("restart", "rpc", "rref")

#: What no unit may import. A unit's imports of itself are never checked.
RULES = (
    Rule("api-imports-nothing", "api is the base: it imports nothing of stalwart",
         importers=("api",), forbidden=("*",)),
    Rule("etcd-client-in-etcd-only", "only stalwart/etcd talks to the etcd client library",
         importers=("*",), exempt=("etcd",), libraries=("pyetcd", "etcd3")),
    Rule("agent-not-operator", "agent and operator never import each other (they meet in api and etcd)",
         importers=("agent",), forbidden=("operator",)),
    Rule("operator-not-agent", "agent and operator never import each other (they meet in api and etcd)",
         importers=("operator",), forbidden=("agent",)),
    Rule("agent-not-rank", "the agent never imports the rank processes' packages (restart, rpc, rref): what "
                           "both sides agree on lives in api or etcd",
         importers=("agent",), forbidden=RANK),
    Rule("rank-not-pod", "restart, rpc and rref run in rank processes and never import agent or operator",
         importers=RANK, forbidden=("agent", "operator")),
    # Of the rank processes' packages only rref builds on another (rpc's public interface); the rest meet in api.
    Rule("rpc-below-rref", "rpc never imports rref nor restart: rref builds on rpc, the environment is in api",
         importers=("rpc",), forbidden=("rref", "restart")),
    Rule("restart-apart", "restart never imports rpc nor rref (what they share lives in api or etcd)",
         importers=("restart",), forbidden=("rpc", "rref")),
    Rule("rref-over-rpc-only", "rref builds on rpc alone of the rank processes' packages, never on restart",
         importers=("rref",), forbidden=("restart",)),
    Rule("leaves-import-nothing", "net, procfs, exits and jitter are used from every layer, so they import nothing "
                                  "of stalwart (an import there could close a cycle through any unit)",
         importers=("net", "procfs", "exits", "jitter"), forbidden=("*",)),
    Rule("forkserver-alone", "the fork server runs before anything of stalwart is set up, in the training "
                             "command's interpreter: it imports nothing of stalwart (it preloads by name)",
         importers=("forkserver",), forbidden=("*",)),
    Rule("local-stays-local", "only the local cluster itself, the demo and the CLI import stalwart/local",
         importers=("*",), exempt=("local", "demo", "cli"), forbidden=("local",)),
)
# Checked by the checker itself, beside RULES: "no-unit-cycles" (no two units import each other, directly or
# around a loop), "public-names-only" (no `_private` name or module is imported across units) and
# "every-unit-placed" (each unit of stalwart/ is in PLACES).

#: Edges allowed for a while, e.g. during a refactor that moves code across layers: each (importing module,
#: imported unit). Empty: the tree keeps every rule. An entry that is no longer needed fails the test.
PENDING: set[tuple[str, str]] = set()


def test_stalwart_keeps_its_layers() -> None:
    report = check(REPO, RULES, PLACES, PENDING)
    assert not report.lines(), "\n".join(report.lines())


def test_the_checker_reads_the_real_tree() -> None:
    """Guards the test above against passing on nothing: it sees a known cross-unit import."""
    imports = collect(REPO)
    assert any(i.module == "stalwart.operator.reconcile" and i.target_unit == "api" for i in imports)


# --- the test of the test: each rule fails on a deliberate bad import ---------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A stalwart/ tree with one empty module in every unit of PLACES, plus ``files`` (path -> source)."""
    pkg = tmp_path / "stalwart"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for unit in PLACES:
        if unit in ("stalwart",):
            continue
        if unit in ("net", "demo", "__main__", "forkserver"):
            (pkg / f"{unit}.py").write_text("")
        else:
            (pkg / unit).mkdir()
            (pkg / unit / "__init__.py").write_text("")
            (pkg / unit / "core.py").write_text("def public() -> None: ...\n")
    for rel, source in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    return tmp_path


BAD = {
    "api-imports-nothing": ("stalwart/api/bad.py", "from stalwart.etcd import core\n"),
    "etcd-client-in-etcd-only": ("stalwart/agent/bad.py", "from pyetcd.etcdrpc import rpc_pb2\n"),
    "agent-not-operator": ("stalwart/agent/bad.py", "import stalwart.operator.core\n"),
    "operator-not-agent": ("stalwart/operator/bad.py", "from stalwart.agent.core import public\n"),
    "agent-not-rank": ("stalwart/agent/bad.py", "def f() -> None:\n    from stalwart.rpc import core\n"),
    "rank-not-pod": ("stalwart/rref/bad.py",
                     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stalwart.agent import core\n"),
    "rpc-below-rref": ("stalwart/rpc/bad.py", "from ..rref.core import public\n"),
    "restart-apart": ("stalwart/restart/bad.py", "from stalwart.rpc import core\n"),
    "rref-over-rpc-only": ("stalwart/rref/bad.py", "import stalwart.restart\n"),
    "local-stays-local": ("stalwart/drill/bad.py", "from stalwart import local\n"),
    "leaves-import-nothing": ("stalwart/exits/bad.py", "from stalwart.api import core\n"),
    "forkserver-alone": ("stalwart/forkserver.py", "from stalwart.api import core\n"),
}


def test_every_rule_has_a_bad_import_below() -> None:
    assert set(BAD) == {r.name for r in RULES}


@pytest.mark.parametrize("rule", sorted(BAD))
def test_a_forbidden_import_fails_naming_its_rule(tmp_path: Path, rule: str) -> None:
    path, source = BAD[rule]
    root = _tree(tmp_path, {path: source})
    report = check(root, RULES, PLACES)
    assert [v.rule for v in report.violations] == [rule]
    (violation,) = report.violations
    assert path in str(violation) and violation.imports[0].line == source.count("\n")


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "stalwart/agent/ok.py": "from stalwart.api import core\nfrom stalwart.etcd import core as c\nimport pyetcd\n",
        "stalwart/etcd/ok.py": "from pyetcd.etcdrpc import rpc_pb2\nfrom ..api.core import public\n",
        "stalwart/rref/ok.py": "from stalwart.rpc.core import public\n",
        "stalwart/cli/ok.py": "from stalwart.local import core\nfrom stalwart.agent import core as a\n",
    })
    report = check(root, RULES, PLACES)
    assert [v.rule for v in report.violations] == ["etcd-client-in-etcd-only"]  # the agent's `import pyetcd`
    assert "stalwart/agent/ok.py:3" in str(report.violations[0])


STRUCTURAL = {
    "no-unit-cycles": ({"stalwart/restart/loop.py": "from stalwart.drill import core\n",
                        "stalwart/drill/loop.py": "from stalwart.examples.core import public\n",
                        "stalwart/examples/loop.py": "import stalwart.restart.core\n"},
                       "units drill <-> examples <-> restart import each other"),
    "public-names-only": ({"stalwart/rref/bad.py": "from stalwart.rpc.core import _hidden\n",
                           "stalwart/rpc/ok.py": "from stalwart.rpc.core import _hidden\n"},
                          "stalwart/rref/bad.py:1 (stalwart.rref.bad) imports stalwart.rpc.core._hidden"),
    "every-unit-placed": ({"stalwart/gadgets/__init__.py": ""}, "stalwart/gadgets has no place in the layering"),
}


@pytest.mark.parametrize("rule", sorted(STRUCTURAL))
def test_a_structural_rule_fails_naming_itself(tmp_path: Path, rule: str) -> None:
    files, expected = STRUCTURAL[rule]
    report = check(_tree(tmp_path, files), RULES, PLACES)
    assert [v.rule for v in report.violations] == [rule]
    assert expected in str(report.violations[0])


def test_a_pending_allowance_exempts_its_edge_and_must_stay_needed(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"stalwart/rpc/bad.py": "from stalwart.rref import core\n",
                            "stalwart/rref/uses.py": "from stalwart.rpc import core\n"})
    assert {v.rule for v in check(root, RULES, PLACES).violations} == {"rpc-below-rref", "no-unit-cycles"}
    allowed = check(root, RULES, PLACES, {("stalwart.rpc.bad", "rref")})
    assert allowed.lines() == []
    stale = check(root, RULES, PLACES, {("stalwart.rpc.bad", "rref"), ("stalwart.agent.core", "restart")})
    assert stale.unused_allowances == [("stalwart.agent.core", "restart")]
    assert "pending-allowance-unused" in stale.lines()[0]
