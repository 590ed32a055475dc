"""Every kind of stall, injected on real rank processes (torch CPU, gloo) and a real etcd: the job leaves it
within its deadline, and recovers. (A rank that neither progresses nor exits needs its agent, which kills it:
see tests/agent/test_agent.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from restart_helpers import expected_checksum, restart_records, run_ranks

from stalwart.api.restart import SealRecord
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration


def test_a_peer_that_never_arrives_is_sealed_out_at_the_barrier_deadline(etcd: EtcdServer, tmp_path: Path) -> None:
    # Rank 1 raises, then hangs in its Finalize policy: alive (its lease is kept), but it never arrives at
    # the next barrier. The barrier seals without it after barrier_timeout and rank 0 trains on alone.
    run = run_ranks(etcd, tmp_path, "--steps", "8", "--fault", "exception", "--fault-step", "4", "--finalize-hang",
                    "--barrier-timeout", "3", until=[0])
    assert run.codes == [0, -9], run.stderr
    [survivor] = run.results
    assert (survivor["rank"], survivor["world"], survivor["step"], survivor["restarts"]) == (0, 1, 8, 1)
    seal = restart_records(etcd, run.keys, "seal")["1"]
    assert seal["timedOut"] and SealRecord.model_validate(seal).ranks == {"0": 0}


def test_a_silent_watch_is_noticed_and_the_spare_still_arrives(etcd: EtcdServer, tmp_path: Path) -> None:
    # Slot 2 waits as an in-process spare on etcd watches, and none of them delivers anything (injected on top
    # of the real etcd streams: a stuck watcher). When rank 1 raises, the spare must still learn of the fault
    # and arrive at the next barrier before it times out (60 s): a silent watch is noticed within
    # WATCH_IDLE_CHECK + the etcd timeout (15 s), and the wait reads again.
    run = run_ranks(etcd, tmp_path, "--steps", "8", "--fault", "exception", "--fault-step", "4",
                    "--silence-slot", "2", "--barrier-timeout", "60", slots=3, target=2)
    assert run.codes == [0, 0, 0], run.stderr
    assert "watch silent" in run.stderr[2]
    seal = restart_records(etcd, run.keys, "seal")["1"]
    assert not seal["timedOut"] and seal["inactive"] == [2]
    reference = expected_checksum(steps=8)
    assert sorted(r["rank"] for r in run.results) == [0, 1]
    assert all(r["step"] == 8 and r["checksum"] == pytest.approx(reference, abs=1e-6) for r in run.results)


def test_a_group_that_is_never_built_fails_within_the_barrier_timeout(etcd: EtcdServer, tmp_path: Path) -> None:
    # In the first iteration rank 1 never reaches its process group (it loops in Python in its Initialize
    # policy: it shows progress, so no soft timeout helps). Rank 0 waits for it in the group's bootstrap; that
    # wait ends at the barrier timeout (3 s), not the collective timeout (60 s): rank 0 records the fault as
    # init_timeout, rank 1 is interrupted, and the next iteration builds the group (the failed init must not
    # leave the ranks looking for each other under different group names).
    run = run_ranks(etcd, tmp_path, "--steps", "8", "--init-stall", "--fault-rank", "1", "--barrier-timeout", "3",
                    "--timeout", "60")
    assert run.codes == [0, 0], run.stderr
    [fault] = restart_records(etcd, run.keys, "fault").values()
    assert (fault["kind"], fault["slot"], fault["iteration"]) == ("init_timeout", 0, 0)
    stalled = float((tmp_path / "init-stall").read_text())
    reference = expected_checksum(steps=8)
    for r in run.results:
        assert r["step"] == 8 and r["restarts"] == 1 and r["checksum"] == pytest.approx(reference, abs=1e-6)
        # Well before the collective timeout (60 s) would have ended the wait.
        assert r["first_after_restart"] - stalled < 30
