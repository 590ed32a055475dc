"""Our randomness stays ours: no module of stalwart/ draws from the global generator of :mod:`random`, which
belongs to the user's script (a rank that seeds it for its data order must get that order whatever our
background threads draw), and our own generator is seeded again in a forked child."""

from __future__ import annotations

import ast
import os
import random
import time
from pathlib import Path

from stalwart.etcd.store import Store
from stalwart.jitter import RNG
from stalwart.local.etcd import EtcdServer

STALWART = Path(__file__).resolve().parents[1] / "stalwart"
#: What may be taken from the module: a generator of one's own.
OWN = {"Random", "SystemRandom"}


def global_draws(source: str) -> list[str]:
    """The uses of the global generator in ``source``: ``random.<draw>`` and ``from random import <draw>``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "random"
                and node.attr not in OWN):
            found.append(f"line {node.lineno}: random.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "random":
            found += [f"line {node.lineno}: from random import {a.name}" for a in node.names if a.name not in OWN]
    return found


def test_the_rule_sees_a_global_draw() -> None:
    assert global_draws("import random\nx = random.random()\n") == ["line 2: random.random"]
    assert global_draws("from random import uniform\n") == ["line 1: from random import uniform"]
    assert global_draws("import random\nr = random.Random()\ns = random.SystemRandom()\n") == []


def test_no_module_draws_from_the_global_generator() -> None:
    found = {str(p.relative_to(STALWART.parent)): d for p in sorted(STALWART.rglob("*.py"))
             if (d := global_draws(p.read_text()))}
    assert not found, f"use stalwart.jitter.RNG (or a generator of your own), not the global one: {found}"


def test_a_keep_alive_leaves_the_users_seeded_generator_alone(etcd: EtcdServer) -> None:
    # Each refresh of a lease draws its jitter: with a TTL of 1 s there are three in the second waited.
    random.seed(1234)
    before = random.getstate()
    with Store([etcd.endpoint], timeout=5.0) as store:
        lease = store.lease_grant(1)
        keepalive = store._keepalive
        assert keepalive is not None
        deadline = time.monotonic() + 10.0
        first = keepalive._answered.get(lease)
        while keepalive._answered.get(lease) == first and time.monotonic() < deadline:
            time.sleep(0.05)
        refreshed = keepalive._answered.get(lease)
        time.sleep(0.8)
        assert refreshed is not None and refreshed != first, "no refresh answered within 10 s"
        store.lease_revoke(lease)
    assert random.getstate() == before


def test_a_forked_child_draws_its_own_jitter() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, repr(RNG.random()).encode())
        os._exit(0)
    os.close(write)
    try:
        child = float(os.read(read, 64).decode())
    finally:
        os.close(read)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child != RNG.random()
