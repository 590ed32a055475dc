"""The partition kinds of ``stalwart drill`` (a member's node cut from everything, etcd, the API server or another
member's node on a ``stalwart local`` cluster, healed after ``--heal-after``): the pure choices as tables, the
recovery after a heal, the cut always healed, and the CLI's errors on bad input, which name the argument and
change nothing."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from stalwart.api.rendezvous import Manifest, Member
from stalwart.cli import main
from stalwart.drill.core import (
    PARTITION_KINDS,
    RankPoint,
    Recovery,
    check_partitions,
    cut_of,
    parse_kinds,
    partition_targets,
    went_on,
)
from stalwart.drill.session import DrillError, DrillOptions, DrillSession

NOW = 1_800_000_000.0
W0, W1, S0 = "job-worker-0", "job-worker-1", "job-spare-0"


def test_the_partition_kinds_parse_but_are_not_drawn_by_default() -> None:
    assert parse_kinds("partition-peer,rank-kill") == ("partition-peer", "rank-kill")
    assert set(PARTITION_KINDS) == {"partition-full", "partition-etcd", "partition-api", "partition-peer"}
    with pytest.raises(ValueError, match=r"--kinds: .* got partition-sideways"):
        parse_kinds("partition-sideways")


@pytest.mark.parametrize(("kinds", "local_dir", "heal_after", "error"), [
    (("rank-kill",), None, 10.0, None),
    (("partition-full", "rank-kill"), "/c", 10.0, None),
    (("partition-full", "rank-kill", "partition-api"), None, 10.0,
     r"--local-dir: partition-full, partition-api cut a node's network on a `stalwart local` cluster"),
    (("rank-kill",), None, 0.0, r"--heal-after: expected seconds > 0, got 0.0"),
    (("partition-etcd",), "/c", -1.0, r"--heal-after: expected seconds > 0, got -1.0"),
    (("partition-etcd",), "/c", float("nan"), r"--heal-after: expected seconds > 0, got nan"),
    (("partition-etcd",), "/c", float("inf"), r"--heal-after: expected seconds > 0, got inf"),
])
def test_check_partitions(kinds: tuple[str, ...], local_dir: str | None, heal_after: float,
                          error: str | None) -> None:
    if error is None:
        check_partitions(kinds, local_dir, heal_after)
    else:
        with pytest.raises(ValueError, match=error):
            check_partitions(kinds, local_dir, heal_after)


@pytest.mark.parametrize(("kind", "peer", "cut"), [
    ("partition-full", "local-0", None),
    ("partition-etcd", None, ["etcd"]),
    ("partition-api", None, ["api"]),
    ("partition-peer", "local-0", ["local-0"]),
])
def test_cut_of(kind: str, peer: str | None, cut: list[str] | None) -> None:
    assert cut_of(kind, peer) == cut


def test_cut_of_bad_kinds() -> None:
    with pytest.raises(ValueError, match="partition-peer: no other member runs on another node"):
        cut_of("partition-peer", None)
    with pytest.raises(ValueError, match="--kinds: 'rank-kill' is not a partition kind"):
        cut_of("rank-kill")


@pytest.mark.parametrize(("node_of", "targets"), [
    # one pod a node: either member, each with the other's node to cut it from
    ({W0: "local-0", W1: "local-1", S0: "local-2"}, [(W0, "local-0", "local-1"), (W1, "local-1", "local-0")]),
    # the spare shares worker-1's node: only worker-0 is alone on its node
    ({W0: "local-0", W1: "local-1", S0: "local-1"}, [(W0, "local-0", "local-1")]),
    # both members on one node: no cut takes one pod
    ({W0: "local-0", W1: "local-0", S0: "local-2"}, []),
    # worker-1 not scheduled (no node): worker-0 is alone, with no other member elsewhere to cut it from
    ({W0: "local-0", W1: None, S0: "local-2"}, [(W0, "local-0", None)]),
])
def test_partition_targets(node_of: dict[str, str | None], targets: list[tuple[str, str, str | None]]) -> None:
    assert partition_targets([W0, W1], node_of, sorted(node_of)) == targets


def point(step: int, step_time: float, *, round_: int = 1, iteration: int = 0, first: int | None = None,
          first_time: float | None = None) -> RankPoint:
    return RankPoint(W0, 0, 0, 0, "running", round_, iteration, step, first, first_time, step_time)


@pytest.mark.parametrize(("pts", "found"), [
    ([point(120, NOW - 1)], None),  # nothing since the cut
    ([point(122, NOW + 3)], None),  # steps during the cut, before the heal (at NOW + 10)
    ([point(123, NOW + 10.5)], Recovery(10.5, 123, 0)),  # the collective went on after the heal
    # a new round during the cut (the spare took over): the recovery as after any fault
    ([point(121, NOW + 6, round_=2, first=119, first_time=NOW + 6)], Recovery(6.0, 119, 2)),
])
def test_went_on(pts: list[RankPoint], found: Recovery | None) -> None:
    assert went_on(pts, (1, 0), NOW, 120, NOW + 10) == found


class Cuts:
    def __init__(self, refuse: bool = False) -> None:
        self.done: list[tuple[str, str, list[str] | None]] = []
        self.refuse = refuse

    def partition(self, node: str, from_: list[str] | None = None) -> list[str]:
        if self.refuse:
            raise DrillError(f"partition {node}: network faults need a network per node")
        self.done.append(("partition", node, from_))
        return []

    def heal(self, node: str) -> str:
        self.done.append(("heal", node, None))
        return "everything"


class OneRound(DrillSession):
    """A session whose job's round and pods are given (no cluster)."""

    def manifest(self) -> Manifest:
        return Manifest(round=1, members=[Member(node_id=n, address=f"10.0.0.{i}", group_rank=i, rank_offset=i,
                                                 nproc=1) for i, n in enumerate((W0, W1))],
                        spares=[S0], world_size=2, master_addr="10.0.0.0", sealed_by=W0)

    def job_pods(self) -> dict[str, str | None]:
        return {W0: "local-0", W1: "local-1", S0: "local-2"}


def first(xs: Sequence[Any]) -> Any:
    return xs[0]


@pytest.mark.parametrize(("kind", "cut"), [("partition-peer", ["local-1"]), ("partition-full", None)])
def test_a_partition_kind_cuts_a_members_node_and_heals_it(kind: str, cut: list[str] | None) -> None:
    cuts = Cuts()
    session = OneRound(api=None, namespace="ns", job="job", progress=io.StringIO(), partitioner=cuts,
                       options=DrillOptions(heal_after=0.01))
    injected, healed, what = session.partition_fault(1, kind, first)
    assert cuts.done == [("partition", "local-0", cut), ("heal", "local-0", None)]
    assert injected <= healed and what == f"{W0} (local-0)"


def test_a_refused_cut_heals_nothing_and_without_a_cluster_none_is_tried() -> None:
    cuts = Cuts(refuse=True)
    session = OneRound(api=None, namespace="ns", job="job", progress=io.StringIO(), partitioner=cuts,
                       options=DrillOptions(heal_after=0.01))
    with pytest.raises(DrillError, match="network faults need a network per node"):
        session.partition_fault(1, "partition-etcd", first)
    assert cuts.done == []
    bare = OneRound(api=None, namespace="ns", job="job", progress=io.StringIO())
    with pytest.raises(DrillError, match="--local-dir: partition-etcd cuts a node's network"):
        bare.partition_fault(1, "partition-etcd", first)


@pytest.mark.parametrize(("args", "said"), [
    (["--kinds", "partition-full"], "stalwart drill: --local-dir: partition-full cut a node's network"),
    (["--kinds", "partition-api", "--local-dir", "/x", "--heal-after", "0"],
     "stalwart drill: --heal-after: expected seconds > 0, got 0.0"),
    (["--kinds", "partition-etcd", "--local-dir", "{tmp}/none"],
     "stalwart drill: --local-dir: no local cluster runs in {tmp}/none"),
    (["--kinds", "partition-bogus"], "stalwart drill: --kinds: expected a comma-separated list of"),
])
def test_the_cli_names_a_bad_argument_and_changes_nothing(args: list[str], said: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Before it reads a kubeconfig or reaches any cluster: the exit code is 2 and stderr says what is wrong."""
    code = main(["drill", "some-job", "--kubeconfig", str(tmp_path / "no-kubeconfig"),
                 *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    err = capsys.readouterr().err
    assert code == 2 and said.replace("{tmp}", str(tmp_path)) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
