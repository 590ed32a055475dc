"""Whether a pod recovers a lost peer in process (stalwart/agent/warm_spares.py): the job's setting where it
is set, else on for a job with spares, a spare parking only once the workers' ranks have shown the restart
wrapper; a pod that arrives while the job runs starting nothing until the round has stepped. Table tests, and the
probes over a real etcd."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from stalwart.agent.rendezvous.view import SealedRound, View
from stalwart.agent.warm_spares import (
    SteppedProbe,
    WrapperProbe,
    joins_late,
    keeps_processes,
    park_now,
    round_stepped,
    shows_wrapper,
)
from stalwart.api.job_record import JobRecord
from stalwart.api.rendezvous import Manifest, Member
from stalwart.api.restart import ProgressRecord, RankReport
from stalwart.api.spec import warm_spares_on
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer


def record(warm: bool | None, spares: int) -> JobRecord:
    return JobRecord(job_name="j", namespace="ns", uid="uid-1", members=["w-0", "w-1"],
                     spares=[f"s-{i}" for i in range(spares)], min_nodes=1, max_nodes=2, nproc_per_node=1,
                     join_timeout_seconds=60, last_call_seconds=1, lease_ttl_seconds=10, max_restarts=3,
                     soft_timeout_seconds=60, hard_timeout_seconds=90, barrier_timeout_seconds=120,
                     warm_spares=warm, backoff_limit=3)


@pytest.mark.parametrize(("setting", "spares", "on"), [
    (None, 0, False),   # no spare: a lost pod is replaced, its peers restart as before
    (None, 1, True),    # spares and nothing said: in process
    (False, 1, False),  # the opt-out
    (True, 0, True),    # asked for: survivors keep their processes and the world shrinks
])
def test_warm_spares_on(setting: bool | None, spares: int, on: bool) -> None:
    assert warm_spares_on(setting, spares) is on


@pytest.mark.parametrize(("forced", "warm", "spares", "spare_ranks", "keeps"), [
    (False, None, 1, False, True),
    (False, None, 0, False, False),
    (False, False, 1, False, False),
    (True, False, 1, False, True),     # --warm-spares on the agent's command line wins
    (False, None, 1, True, False),     # --spare-ranks keeps a spare's ranks its own way
    (False, True, 1, True, True),
])
def test_keeps_processes(forced: bool, warm: bool | None, spares: int, spare_ranks: bool, keeps: bool) -> None:
    assert keeps_processes(forced, record(warm, spares), spare_ranks=spare_ranks) is keeps


def test_without_the_job_record_nothing_is_kept() -> None:
    assert keeps_processes(False, None) is False


def never_asked() -> bool:
    raise AssertionError("the probe is asked only when the setting is unset")


@pytest.mark.parametrize(("forced", "warm", "spares", "shown", "park"), [
    (False, True, 1, never_asked, True),          # set: park at once
    (False, False, 1, never_asked, False),
    (True, None, 0, never_asked, True),
    (False, None, 1, lambda: False, False),       # unset: not before a worker's ranks showed the wrapper
    (False, None, 1, lambda: True, True),
    (False, None, 0, lambda: True, False),        # no spares in the job
])
def test_park_now(forced: bool, warm: bool | None, spares: int, shown: Callable[[], bool], park: bool) -> None:
    assert park_now(forced, record(warm, spares), shown) is park


def test_park_now_without_the_job_record() -> None:
    assert park_now(False, None, never_asked) is False


def report(node: str, *states: str | None) -> ProgressRecord:
    ranks = [RankReport(local_rank=i, slot=i, pid=100 + i, state=s) for i, s in enumerate(states)]
    return ProgressRecord(node_id=node, epoch=1, round=1, state="running", updated=1.0, ranks=ranks)


@pytest.mark.parametrize(("reports", "shown"), [
    ([], False),
    ([report("w-0", None)], False),                        # a rank that wrote no status file: a plain script
    ([report("w-0", None), report("w-1", None, "running")], True),
    ([report("w-0", "starting")], True),
])
def test_shows_wrapper(reports: list[ProgressRecord], shown: bool) -> None:
    assert shows_wrapper(reports) is shown


@pytest.mark.integration
def test_the_probe_reads_the_reports_until_one_shows_the_wrapper(etcd: EtcdServer) -> None:
    keys = JobKeys("ns", "uid-probe")
    with Store([etcd.endpoint]) as store:
        probe = WrapperProbe(store, keys, interval=0.0)
        assert probe() is False  # no report yet
        store.put(keys.progress_of("w-0"), report("w-0", None).to_json_bytes())
        store.put(keys.progress_of("w-1"), b"not json")  # skipped, does not hide the others
        assert probe() is False
        store.put(keys.progress_of("w-0"), report("w-0", "running").to_json_bytes())
        assert probe() is True
        store.delete_prefix(keys.prefix)
        assert probe() is True  # once shown, not read again


def sealed(*members: str, spares: tuple[str, ...] = (), round_: int = 2) -> View:
    ms = [Member(node_id=n, address=f"10.0.0.{i}", group_rank=i, rank_offset=i, nproc=1)
          for i, n in enumerate(members)]
    m = Manifest(round=round_, members=ms, spares=list(spares), world_size=len(ms), master_addr="10.0.0.0",
                 sealed_by=members[0])
    return View(revision=9, sealed=SealedRound.of(m, 9))


@pytest.mark.parametrize(("view", "node", "late"), [
    (View(), "s-1", False),                             # no round yet: the job is starting, all start at once
    (sealed("w-0", "w-1"), "s-1", True),               # a replacement: the round was sealed without it
    (sealed("w-0", "w-1", round_=1), "s-0", False),    # a spare of the first round, scheduled after its seal
    (sealed("w-0", "w-1"), "w-1", False),              # a member's pod back (it is in the round)
    (sealed("w-0", "w-1", spares=("s-0",)), "s-0", False),
])
def test_joins_late(view: View, node: str, late: bool) -> None:
    assert joins_late(view, node) is late


def stepped(node: str, *ranks: tuple[int | None, int | None, int | None], epoch: int = 9) -> ProgressRecord:
    """A report of ``node`` whose ranks are (rank, first step, last step)."""
    reports = [RankReport(local_rank=i, slot=i, pid=100 + i, rank=r, state="running", first_step=first, step=last)
               for i, (r, first, last) in enumerate(ranks)]
    return ProgressRecord(node_id=node, epoch=epoch, round=2, state="running", updated=1.0, ranks=reports)


@pytest.mark.parametrize(("reports", "done"), [
    ([], False),
    ([stepped("w-0", (0, 40, 41)), stepped("w-1", (1, 40, 41))], True),
    ([stepped("w-0", (0, 40, 41)), stepped("w-1", (1, 40, 40))], False),         # w-1 is in its first step
    ([stepped("w-0", (0, 40, 41)), stepped("w-1", (1, None, None))], False),     # w-1 has not stepped at all
    ([stepped("w-0", (0, 40, 41)), stepped("w-1", (1, 40, 41), epoch=8)], False),  # w-1's report is old
    ([stepped("w-0", (0, 40, 41), (1, 40, 40)), stepped("w-1", (2, 40, 41))], False),  # one rank of two
    ([stepped("w-0", (0, 40, 41), (None, None, None)), stepped("w-1", (1, 40, 41))], True),  # an inactive slot
    ([stepped("w-0", (0, 40, 41)), stepped("s-0")], False),                      # a spare reports no ranks
])
def test_round_stepped(reports: list[ProgressRecord], done: bool) -> None:
    assert round_stepped(reports, 9, 2) is done


def test_round_stepped_of_no_members() -> None:
    assert round_stepped([stepped("w-0", (0, 40, 41))], 9, 0) is False


@pytest.mark.integration
def test_the_stepped_probe_reads_until_every_member_stepped(etcd: EtcdServer) -> None:
    keys = JobKeys("ns", "uid-stepped")
    with Store([etcd.endpoint]) as store:
        probe = SteppedProbe(store, keys, 9, 2, interval=0.0)
        store.put(keys.progress_of("w-0"), stepped("w-0", (0, 40, 41)).to_json_bytes())
        store.put(keys.progress_of("w-1"), stepped("w-1", (1, 40, 40)).to_json_bytes())
        assert probe() is False
        store.put(keys.progress_of("w-1"), stepped("w-1", (1, 40, 41)).to_json_bytes())
        assert probe() is True
        store.delete_prefix(keys.prefix)
        assert probe() is True  # once stepped, not read again


@pytest.mark.integration
def test_the_stepped_probe_gives_up_waiting_after_its_limit(etcd: EtcdServer) -> None:
    keys = JobKeys("ns", "uid-limit")  # no report ever: a script that reports no steps
    with Store([etcd.endpoint]) as store:
        probe = SteppedProbe(store, keys, 9, 2, interval=0.0, limit=0.3)
        assert probe() is False
        time.sleep(0.35)
        assert probe() is True
