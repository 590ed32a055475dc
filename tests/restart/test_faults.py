"""Every fault of the issue, on real rank processes (torch CPU, gloo) coordinated through a real etcd.

Training is deterministic (see bench/restart_ddp.py), so after recovery the parameters must equal those of a
fault-free run: that, and the step count, is what each test asserts.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
from restart_helpers import Run, expected_checksum, new_job, restart_records, run_ranks

from stalwart.api import pod_env
from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import FaultRecord
from stalwart.etcd.faults import record_fault
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration

STEPS = ["--steps", "8"]


@pytest.fixture(scope="module")
def reference() -> float:
    """The parameters after 8 fault-free steps of 2 ranks."""
    return expected_checksum(steps=8)


def assert_recovered(run: Run, reference: float, *, ranks: int = 2, restarts: int = 1) -> None:
    """Every rank ended 0 at the last step with the fault-free checksum, at the full world, after ``restarts``
    restarts; on failure the ranks' logs say why (under load, once, the hung rank ended itself as ABANDONED)."""
    run_codes, results = run.codes, run.results
    if run_codes != [0] * len(run_codes):
        for slot, err in enumerate(run.stderr):  # printed whole: an assertion's message is cut short
            print(f"--- slot {slot} (exit code {run_codes[slot]}):\n{err[-12000:]}")
    assert run_codes == [0] * len(run_codes), run_codes
    assert sorted(r["rank"] for r in results if r["world"] == ranks) == list(range(ranks))
    for r in results:
        assert r["step"] == 8
        assert r["checksum"] == pytest.approx(reference, abs=1e-6)
        assert r["restarts"] >= restarts


def test_exception_in_one_rank(etcd: EtcdServer, tmp_path: Path, reference: float) -> None:
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "exception", "--fault-step", "4")
    assert_recovered(run, reference)
    assert all(r["restarts"] == 1 for r in run.results)


def test_fault_in_the_first_iteration_before_any_step(etcd: EtcdServer, tmp_path: Path, reference: float) -> None:
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "exception", "--fault-step", "0", "--fault-rank", "0")
    assert_recovered(run, reference)


def test_hang_past_the_soft_timeout(etcd: EtcdServer, tmp_path: Path, reference: float) -> None:
    # Rank 1 blocks in a sleep (no Python runs on its main thread), and rank 0 then in its collective: the
    # first monitor to see no progress records the hang within the soft timeout + 2 s and both restart.
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "hang", "--fault-step", "3", "--soft-timeout", "3")
    assert_recovered(run, reference)
    hung = float((tmp_path / "fault-0").read_text())
    faults = [f for key, f in restart_records(etcd, run.keys, "fault").items() if key.startswith("0/")]
    first = min(faults, key=lambda f: f["time"])
    # On failure, the records and the ranks' logs say which process recorded what, and when.
    assert first["kind"] == "soft_timeout", (faults, run.stderr)
    # Within the soft timeout (3 s) and 2 s of scheduling on a loaded machine (two suites at once: 4.3 s), still
    # before the hard timeout (6 s), whose kill would be a different fault.
    assert first["time"] - hung <= 3 + 2, (faults, run.stderr)


def test_a_hang_reported_slowly_stays_the_cause_when_its_peer_closes_first(etcd: EtcdServer, tmp_path: Path,
                                                                          reference: float) -> None:
    # Rank 1 spins in Python (progress to its own monitor: it reports nothing). Rank 0 waits in its collective,
    # its soft timeout fires and its report is written, but etcd answers 2 s late. Rank 1, interrupted by that
    # record, closes its connections, and rank 0's collective fails before its own monitor has asked for the
    # interrupt: that error is the hang's consequence and must not be recorded over the hang's report.
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "spin", "--fault-step", "3", "--soft-timeout", "3",
                    "--slow-report", "2")
    assert_recovered(run, reference)
    faults = restart_records(etcd, run.keys, "fault")
    assert [(key, f["kind"]) for key, f in sorted(faults.items())] == [("0/0", "soft_timeout")], faults


def test_second_fault_during_the_restart(etcd: EtcdServer, tmp_path: Path, reference: float) -> None:
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "exception", "--fault-step", "4",
                    "--second-fault", "exception")
    assert_recovered(run, reference, restarts=2)
    assert (tmp_path / "second-0").exists()


def test_rank_that_never_comes_back_shrinks_the_world(etcd: EtcdServer, tmp_path: Path) -> None:
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "sigkill", "--fault-step", "4", "--barrier-timeout", "3")
    assert run.codes[1] == -9
    assert run.codes[0] == 0
    [survivor] = run.results
    assert survivor["world"] == 1 and survivor["rank"] == 0 and survivor["step"] == 8


def test_rank_that_never_comes_back_is_replaced_by_a_spare(etcd: EtcdServer, tmp_path: Path,
                                                           reference: float) -> None:
    # Three processes, two active; slot 2 waits as a spare and takes over rank 1 when slot 1 dies for good.
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "sigkill", "--fault-step", "4", "--barrier-timeout", "3",
                    slots=3, target=2)
    assert run.codes == [0, -9, 0]
    assert {r["pid"] for r in run.results} and len(run.results) == 2
    by_rank = run.by_rank()
    assert set(by_rank) == {0, 1}
    for r in run.results:
        assert r["world"] == 2 and r["step"] == 8
        assert r["checksum"] == pytest.approx(reference, abs=1e-6)


def test_too_few_ranks_left_exits_world_too_small(etcd: EtcdServer, tmp_path: Path) -> None:
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "sigkill", "--fault-step", "2", "--barrier-timeout", "2",
                    "--min-world", "2")
    assert run.codes == [int(ExitCode.WORLD_TOO_SMALL), -9]


def test_the_jobs_minimum_from_the_agent_holds_whatever_the_decorator_says(etcd: EtcdServer, tmp_path: Path) -> None:
    # The script's decorator allows a world of 1; the job's minimum (minReplicas x nprocPerNode) is 2.
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "sigkill", "--fault-step", "2", "--barrier-timeout", "2",
                    extra_env={pod_env.MIN_WORLD: "2"})
    assert run.codes == [int(ExitCode.WORLD_TOO_SMALL), -9]
    [seal] = [s for s in restart_records(etcd, run.keys, "seal").values() if s.get("error")]
    assert "min_world_size is 2" in seal["error"]


def test_the_agents_record_of_the_previous_process_interrupts_the_one_respawned_in_its_slot(
        etcd: EtcdServer, tmp_path: Path, reference: float) -> None:
    # Slot 1's previous process was killed at the barrier of iteration 0 and its agent recorded that: the process
    # respawned in the slot must take the record as a peer's fault (its own slot, another process) and restart
    # with slot 0, not run the faulted iteration alone while slot 0 waits at the next barrier.
    with Store([etcd.endpoint]) as store:
        keys, epoch = new_job(store)
        assert record_fault(store, keys, epoch, FaultRecord(
            slot=1, pid=1, node_id="node-0", iteration=0, kind="hard_timeout", reason="killed", time=time.time()))
    run = run_ranks(etcd, tmp_path, *STEPS, "--barrier-timeout", "30", job=(keys, epoch))
    assert_recovered(run, reference)
    assert sorted((r["rank"], r["world"], r["restarts"]) for r in run.results) == [(0, 2, 1), (1, 2, 1)]
    # Interrupted by the record, as its peer was, it reported nothing of its own there (a report would replace
    # the record): it was not left to fail on its own in the faulted iteration.
    faults = restart_records(etcd, keys, "fault")
    assert (faults["0/1"]["pid"], faults["0/1"]["kind"]) == (1, "hard_timeout"), faults


def test_restart_budget_exhausted(etcd: EtcdServer, tmp_path: Path) -> None:
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "exception-always", "--fault-step", "1",
                    "--max-restarts", "2")
    assert run.codes == [int(ExitCode.RESTARTS_EXHAUSTED)] * 2
    assert run.results == []


def assert_no_growth(reports: dict[int, dict[str, Any]], what: str) -> None:
    """A leak stays: every report after it counts more. A thread or descriptor still ending when a report was
    taken (a helper thread of an etcd call ended just before, on a loaded machine: the report names the
    threads) shows in that report only and is gone by the next (each report is the least of four samples over
    0.3 s, so one ending within that is not counted at all). So the floor is the least count, and no two reports
    in a row may be above it."""
    floor = min(r[what] for r in reports.values())
    its = sorted(reports)
    for a, b in itertools.pairwise(its):
        assert not (reports[a][what] > floor and reports[b][what] > floor), \
            (what, floor, {it: reports[it][what] for it in its}, reports[a], reports[b])


def test_twenty_restarts_leak_nothing(etcd: EtcdServer, tmp_path: Path, reference: float) -> None:
    run = run_ranks(etcd, tmp_path, *STEPS, "--fault", "exception", "--fault-step", "3", "--faults", "20",
                    "--max-restarts", "25", "--leak-report")
    assert_recovered(run, reference, restarts=20)
    for rank in (0, 1):
        reports = {r["iteration"]: r for r in run.leaks if r["rank"] == rank}
        assert sorted(reports) == list(range(21))
        # From iteration 1 on (the first restart opened the etcd watches the rest reuse) nothing may grow.
        for what in ("threads", "native_threads", "fds", "etcd_keys"):
            assert_no_growth({it: reports[it] for it in range(1, 21)}, what)
        assert all(reports[it]["children"] == 0 for it in range(21)), reports
        # Keys: only the previous and the current iteration's are kept, older ones are deleted. Each restart
        # records one fault, the raise: the peer's error that follows it (its collective broken by the abort)
        # is a consequence, not a fault of its own.
        for it in range(1, 21):
            r = reports[it]
            assert r["iterations"] == [it - 1, it], (it, r)
            assert r["faults"] == {str(it - 1): 1}, (it, r)
    # After the job: the restart prefix holds at most two iterations' keys, whatever the number of restarts.
    with Store([etcd.endpoint]) as s:
        kvs, _ = s.get_prefix(run.keys.restart, keys_only=True)
    iterations = {int(kv.key.split("/")[-2]) for kv in kvs
                  if not any(single in kv.key for single in ("/seal/", "/alive/", "/end/"))}
    assert iterations <= {19, 20}
    assert {kv.key.rsplit("/", 1)[1] for kv in kvs if "/end/" in kv.key} == {"20"}  # the last mark's END
    assert not [kv for kv in kvs if "/alive/" in kv.key]


def test_a_peer_whose_heartbeat_lease_ends_interrupts_the_iteration(etcd: EtcdServer, tmp_path: Path,
                                                                   reference: float) -> None:
    # Fault injection on the real etcd: slot 1's heartbeat lease is revoked while it trains (as if it had
    # been cut off past its TTL). Slot 0 notices by watch and restarts; slot 1 gets a new lease and rejoins.
    import threading

    from stalwart.api.restart import RankStatus

    with Store([etcd.endpoint]) as s:
        keys, epoch = new_job(s)

    def revoke_when_training() -> None:
        status = tmp_path / "status-1.json"
        alive = f"{keys.restart}{epoch}/alive/1"
        with Store([etcd.endpoint]) as s:
            for _ in range(2400):
                try:
                    st = RankStatus.from_json_bytes(status.read_bytes())
                except (OSError, ValueError):
                    st = None
                kv = s.get(alive)
                if st is not None and st.state == "running" and (st.step or 0) >= 2 and kv is not None:
                    s.lease_revoke(kv.lease)
                    return
                threading.Event().wait(0.1)

    t = threading.Thread(target=revoke_when_training, daemon=True)
    t.start()
    run = run_ranks(etcd, tmp_path, "--steps", "8", "--step-sleep", "0.3", job=(keys, epoch))
    t.join(30)
    assert_recovered(run, reference)


def test_etcd_restarting_mid_training_and_a_fault_after_it(private_etcd: EtcdServer, tmp_path: Path) -> None:
    # etcd goes away for a while during training (the monitors' watches break and reconnect); a fault
    # afterwards is handled through the restarted server as usual.
    import threading

    from stalwart.api.restart import RankStatus

    def bounce_etcd() -> None:
        status = tmp_path / "status-0.json"
        for _ in range(2400):
            try:
                st = RankStatus.from_json_bytes(status.read_bytes())
            except (OSError, ValueError):
                st = None
            if st is not None and (st.step or 0) >= 2:
                private_etcd.stop()
                threading.Event().wait(1.0)  # the outage being injected, not a synchronisation
                private_etcd.start()
                return
            threading.Event().wait(0.1)

    t = threading.Thread(target=bounce_etcd, daemon=True)
    t.start()
    run = run_ranks(private_etcd, tmp_path, "--steps", "12", "--step-sleep", "0.3", "--fault", "exception",
                    "--fault-step", "9")
    t.join(60)
    assert run.codes == [0, 0], run.stderr
    reference = expected_checksum(steps=12)
    for r in run.results:
        assert r["step"] == 12 and r["restarts"] == 1
        assert r["checksum"] == pytest.approx(reference, abs=1e-6)
