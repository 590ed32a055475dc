"""The pure parts of fault drills: signed requests, the agent's verdict on them, the plan, recovery, the table."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from stalwart.agent.drill import judge
from stalwart.api.drill import DrillRequest
from stalwart.api.recovery import RecoveryPhases
from stalwart.cli.drill import context_namespace
from stalwart.drill.core import (
    RankPoint,
    Recovery,
    Row,
    format_table,
    parse_kinds,
    plan,
    recovery,
    standing,
    status_summary,
)
from stalwart.drill.session import DrillOptions, DrillSession

TOKEN = b"the-job-token"
NOW = 1_800_000_000.0


def request(**over: object) -> DrillRequest:
    base: dict[str, object] = {"id": "ab" * 16, "job_uid": "uid-1", "node_id": "job-worker-1", "local_rank": 0,
                               "kind": "rank-kill", "issued": NOW, "expires": NOW + 120}
    base.update(over)
    return DrillRequest.model_validate(base).signed(TOKEN)


@pytest.mark.parametrize(("req", "token", "enabled", "now", "answered_refusal"), [
    (request(), TOKEN, True, NOW + 1, (False, None)),
    (request(), b"another-token", True, NOW + 1, (False, "not signed with the job's token")),
    (request(), None, True, NOW + 1, (False, "no job token")),
    (request().model_copy(update={"kind": "rank-hang"}), TOKEN, True, NOW + 1, (False,
     "not signed with the job's token")),  # altered after signing
    (request(job_uid="uid-2"), TOKEN, True, NOW + 1, (False, "for job uid-2")),
    (request(), TOKEN, False, NOW + 1, (False, "fault injection is not enabled")),
    (request(), TOKEN, True, NOW + 121, (False, "expired")),
    (request(issued=NOW + 100, expires=NOW + 200), TOKEN, True, NOW, (False, "issued in the future")),
    (request(expires=NOW + 3600), TOKEN, True, NOW + 1, (False, "valid for longer")),
    (request(), TOKEN, True, NOW + 1, (True, "a replay")),
    # Checked first: a caller without the token learns nothing about the job's settings.
    (request(job_uid="uid-2"), b"wrong", False, NOW + 999, (True, "not signed with the job's token")),
], ids=["ok", "wrong-token", "no-token", "tampered", "other-job", "not-opted-in", "expired", "future",
        "too-long", "replay", "signature-first"])
def test_judge(req: DrillRequest, token: bytes | None, enabled: bool, now: float,
               answered_refusal: tuple[bool, str | None]) -> None:
    answered, refusal = answered_refusal
    verdict = judge(req, token=token, job_uid="uid-1", enabled=enabled, now=now, answered=answered)
    if refusal is None:
        assert verdict is None
    else:
        assert verdict is not None and refusal in verdict


def test_requests_are_json_and_their_ids_are_checked() -> None:
    req = request()
    assert DrillRequest.from_json_bytes(req.to_json_bytes()) == req and req.verify(TOKEN)
    with pytest.raises(ValueError, match="hex"):
        request(id="../../etc")


def test_parse_kinds_and_plan() -> None:
    assert parse_kinds("rank-kill, pod-delete,rank-kill") == ("rank-kill", "pod-delete")
    with pytest.raises(ValueError, match=r"--kinds: .* got rank-explode"):
        parse_kinds("rank-explode")
    with pytest.raises(ValueError, match="--faults"):
        plan(0, ("rank-kill",), 1)
    drawn = plan(7, ("a", "b", "c"), seed=5)
    assert sorted(drawn[:3]) == ["a", "b", "c"] and sorted(drawn[3:6]) == ["a", "b", "c"] and len(drawn) == 7
    assert plan(7, ("a", "b", "c"), seed=5) == drawn


def point(node: str, round_: int, iteration: int, step: int | None, *, first: int | None = None,
          first_time: float | None = None) -> RankPoint:
    return RankPoint(node, 0, 0, 0, "running", round_, iteration, step, first, first_time)


def test_recovery_is_the_first_step_of_a_later_iteration_or_round_after_the_fault() -> None:
    before = [point("a", 1, 0, 120), point("b", 1, 0, 121)]
    assert standing(before) == ((1, 0), 121)
    # The new iteration has started but not stepped; an old first step (before the fault) does not count.
    started = [point("a", 1, 1, 121), point("b", 1, 0, 121, first=1, first_time=NOW - 60)]
    assert recovery(started, (1, 0), NOW, 121) is None
    rec = recovery([point("a", 1, 1, 123, first=122, first_time=NOW + 0.4),
                    point("b", 1, 1, 122, first=122, first_time=NOW + 0.2)], (1, 0), NOW, 121)
    assert rec == Recovery(0.2, 122, 0)
    # A new round from the checkpoint at step 100: 21 steps done again.
    assert recovery([point("c", 2, 0, 101, first=101, first_time=NOW + 9)], (1, 0), NOW, 121) == Recovery(9.0, 101, 21)


def test_the_table_and_the_status_line() -> None:
    status = {"phase": "Running", "restarts": {"inProcess": 1, "processRestarts": 2, "podReplacements": 1},
              "lastFailure": {"reason": "ProcessExited", "signal": "SIGKILL", "rank": 0, "pod": "job-worker-0"}}
    line = status_summary(status)
    assert line == ("Running; restarts 1 in-process/2 process/1 pod; "
                    "lastFailure ProcessExited SIGKILL (rank 0, job-worker-0)")
    table = format_table([Row(1, "rank-kill", "rank 0 (job-worker-0)", Recovery(3.25, 51, 0), line),
                          Row(2, "pod-delete", "job-worker-1", None, "Restarting", note="not within 300s")])
    header, first, second = table.splitlines()
    assert header.split() == ["#", "FAULT", "TARGET", "RECOVERY", "RECOMPUTED", "STATUS", "AFTER"]
    assert first.index("3.2s") == header.index("RECOVERY") and first.endswith(line)
    assert "not within 300s" in second and second.rstrip().endswith("Restarting")


def test_the_phases_of_a_recovery_go_under_its_row() -> None:
    phases = RecoveryPhases(seconds=(("detect", 0.01), ("round", 1.2), ("group", 0.05), ("prepare", 0.0),
                                     ("copy", 0.4), ("first_step", 0.3)), raw=1.96, copy_bytes=800_000_000,
                            copy_sources=2)
    late = RecoveryPhases(seconds=(("detect", None), ("round", 5.0), ("group", 0.1), ("prepare", None),
                                   ("copy", None), ("first_step", 2.0)), raw=7.1)
    table = format_table([Row(1, "pod-delete", "job-worker-1", Recovery(1.96, 51, 0), "Running", phases=phases),
                          Row(2, "rank-kill", "rank 0 (job-worker-0)", Recovery(7.1, 60, 0), "Running", phases=late)])
    _, _, under, _, under_late = table.splitlines()
    assert under == ("    phases: detect 0.01s, round 1.20s, group 0.05s, prepare 0.00s, copy 0.40s (800 MB from 2, "
                     "2.00 GB/s), first step 0.30s; fault to first full step 1.96s")
    assert under_late.startswith("    phases: detect n/a, round 5.00s") and "copy n/a," in under_late


@pytest.mark.parametrize(("context", "namespace"), [({"namespace": "team-a"}, "team-a"), ({}, "default")])
def test_the_namespace_defaults_to_the_kubeconfigs_context(tmp_path: Path, context: dict[str, str],
                                                             namespace: str) -> None:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
              "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", **context}}],
              "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
              "users": [{"name": "u", "user": {"token": "t"}}]}
    (tmp_path / "config").write_text(json.dumps(config))
    assert context_namespace(str(tmp_path / "config")) == namespace


def test_a_drill_says_what_it_waits_for_while_a_fault_has_not_recovered() -> None:
    class Stuck(DrillSession):
        def records(self) -> list[Any]:
            return []

        def status(self) -> dict[str, Any]:
            return {"phase": "Running"}

    said = io.StringIO()
    table = io.StringIO()
    session = Stuck(api=None, namespace="ns", job="j", out=table, progress=said,
                    options=DrillOptions(timeout=0.5, poll=0.02, progress_every=0.1))
    assert session.wait_recovered((1, 0), 0.0, 0) is None
    lines = said.getvalue().splitlines()
    assert len(lines) >= 3 and all(line.startswith("  still waiting: ") and line.endswith("phase Running")
                                   for line in lines)
    assert table.getvalue() == ""  # the table stays the table


def test_a_drill_reads_the_phases_of_the_recovery_from_the_agents_records() -> None:
    from stalwart.api.restart import ProgressRecord, RankReport, RecoveryMarks

    def record(node: str, rank: int, marks: RecoveryMarks | None, first: float | None) -> ProgressRecord:
        return ProgressRecord(node_id=node, epoch=3, round=2, state="running", updated=NOW + 9, ranks=[
            RankReport(local_rank=0, slot=rank, rank=rank, pid=10 + rank, state="running", first_step_time=first,
                       recovery=marks)])

    marks = RecoveryMarks(epoch=3, iteration=0, knew=NOW + 0.1, sealed=NOW + 1, group=NOW + 1.1)
    reports = [[record("w0", 0, marks, NOW + 2), record("s0", 1, None, None)],  # the spare has not said yet
               [record("w0", 0, marks, NOW + 2), record("s0", 1, marks, NOW + 2.5)]]

    class Recovering(DrillSession):
        def records(self) -> list[Any]:
            return reports.pop(0) if len(reports) > 1 else reports[0]

    session = Recovering(api=None, namespace="ns", job="j", options=DrillOptions(settle=5, poll=0.01))
    phases = session.wait_phases(NOW)
    assert phases is not None and phases.raw == pytest.approx(2.5)
    assert phases.of("detect") == pytest.approx(0.1) and phases.of("copy") is None
