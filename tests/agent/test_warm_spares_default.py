"""Whether a pod recovers a lost peer in process (stalwart/agent/warm_spares.py): the job's setting where it
is set, else on for a job with spares, a spare parking only once the workers' ranks have shown the restart
wrapper. Table tests, and the probe over a real etcd."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from stalwart.agent.warm_spares import WrapperProbe, keeps_processes, park_now, shows_wrapper
from stalwart.api.job_record import JobRecord
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
