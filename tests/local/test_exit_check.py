"""The exit check (stalwart/local/exitcheck.py) can fail: a process that logged its ``leaving with exit code``
line and then lingered, one still running, one that left a process behind are each reported, named, with their
last log lines; one that left at once is not, nor a container whose main process is a shell around the process
that logged (the kubelet sees the shell's end, not that process's). Through the kubelet's book (pods of the
session cluster) and
through WatchedProcess (a process a test starts itself). The autouse fixture judges these tests too: each
lingering process is ended well within the fixture's own bound."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from local_helpers import phase_is, wait_until

from stalwart.local.cluster import LocalCluster
from stalwart.local.containerbook import BOOK, read_book
from stalwart.local.exitcheck import (
    BOOK_GRACE,
    ClusterExits,
    WatchedProcess,
    follow,
    judge_watched,
    log_facts,
    take_watched,
)

pytestmark = pytest.mark.integration

LOG = "import logging; logging.basicConfig(level='INFO', format='%(asctime)s %(levelname)s %(name)s: %(message)s')"


def leaving_then(after: str) -> str:
    """A script that logs the exit line of stalwart.exits, then runs ``after``."""
    return (f"{LOG}; logging.getLogger('stalwart.exits').info('job=t node=n: leaving with exit code 0 "
            f"(bound 10s)'); import time, subprocess, sys; {after}")


def test_log_facts_reads_the_decision_the_leaving_line_and_the_ranks_return() -> None:
    text = "\n".join([
        "2030-01-02 03:04:05,100 INFO stalwart.agent.runner: job=a node=b: round 1 (epoch 7) as member",
        json.dumps({"event": "done", "time": 1893553445.5, "rank": 0}),
        "2030-01-02 03:04:06,250 INFO stalwart.agent.runner: job=a node=b: every rank returned",
        "2030-01-02 03:04:07,000 INFO stalwart.exits: job=a node=b: leaving with exit code 0 (bound 10s)",
    ])
    facts = log_facts(text)
    assert facts.bound == 10.0 and facts.limit(None) == 15.0 and facts.limit(1.0) == 1.0
    assert facts.leaving is not None and facts.decided is not None
    assert facts.leaving - facts.decided == pytest.approx(0.75, abs=1e-3)
    assert facts.returned == 1893553445.5
    assert facts.tail[-1].endswith("(bound 10s)")
    assert log_facts("plain output\n").decided is None


def test_only_the_judged_process_s_own_words_are_its_decision() -> None:
    # An agent whose ranks write to its log: a rank's error that says "every rank returned" is no decision of the
    # agent's, nor is a rank's own leaving line (its pid is not the agent's); the agent's own are.
    rank_error = ("2030-01-02 03:04:05,000 WARNING stalwart.restart.wrapper: slot 0 rank 0 iteration 3: fault: "
                  "RestartInterrupt('a peer failed before every rank returned')")
    timed_out = ("2030-01-02 03:04:05,100 WARNING stalwart.restart.wrapper: slot 0 rank 0 iteration 3: "
                 "completion_timeout: not every rank returned within 30s")
    rank_leaves = "2030-01-02 03:04:05,200 INFO stalwart.exits: slot 0: leaving with exit code 98 (bound 10s, pid 222)"
    assert log_facts("\n".join([rank_error, timed_out, rank_leaves]), pid=111).decided is None
    # Without the pid to tell them apart, a leaving line is taken as the process's own (a single process's log).
    assert log_facts(rank_leaves).leaving is not None
    agent_leaves = ("2030-01-02 03:04:09,000 INFO stalwart.exits: job=a node=b: leaving with exit code 0 "
                    "(bound 10s, pid 111)")
    returned = "2030-01-02 03:04:08,000 INFO stalwart.agent.runner: job=a node=b: every rank returned"
    facts = log_facts("\n".join([rank_error, rank_leaves, returned, agent_leaves]), pid=111)
    assert (facts.decided, facts.leaving, facts.bound) == (_stamp_of(returned), _stamp_of(agent_leaves), 10.0)


def _stamp_of(line: str) -> float:
    return time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000


def _book_with_one_start(directory: Path, pid: int, log: Path) -> None:
    record = {"event": "started", "time": time.time(), "namespace": "ns", "pod": "p", "uid": "u",
              "container": "c", "pid": pid, "log": str(log), "argv": ["python"]}
    (directory / BOOK).write_text(json.dumps(record) + "\n")


def _just_left(log: Path) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S,000")
    log.write_text(f"{stamp} INFO stalwart.exits: job=t node=n: leaving with exit code 0 (bound 10s)\n")


def test_a_container_gone_before_the_book_notes_its_end_is_not_called_running(tmp_path: Path) -> None:
    # The process has left (its pid is no container's any more) a moment after its leaving line, and the kubelet
    # has not yet written the end: it is waited for, then judged as ended when it was seen gone, not as running.
    gone = WatchedProcess([sys.executable, "-c", "pass"])
    gone.communicate(timeout=60)
    take_watched()
    log = tmp_path / "c.log"
    _just_left(log)
    _book_with_one_start(tmp_path, gone.pid, log)
    exits = ClusterExits(tmp_path)
    began = time.monotonic()
    assert exits.judge() == []
    assert time.monotonic() - began >= BOOK_GRACE - 0.5  # it waited for the book first
    assert exits.instances[("u", "c", gone.pid)].gone is not None


def test_a_container_that_is_still_running_past_its_bound_is_reported(tmp_path: Path) -> None:
    # The same book, but the process is alive and this check's bound is short: reported as still running.
    from stalwart.local.processes import CONTAINER_MARKER, container_id

    env = {CONTAINER_MARKER: container_id("u", "c")}
    alive = WatchedProcess([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
    take_watched()
    try:
        log = tmp_path / "c.log"
        _just_left(log)
        _book_with_one_start(tmp_path, alive.pid, log)
        problems = ClusterExits(tmp_path).judge(bound=1.0)
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert [p.what.split(" ")[:2] for p in problems] == [["still", "running"]]


def test_watched_processes_late_alive_and_prompt_are_told_apart() -> None:
    prompt = WatchedProcess([sys.executable, "-c", leaving_then("pass")], stderr=-1, text=True)
    late = WatchedProcess([sys.executable, "-c", leaving_then("time.sleep(2.5)")], stderr=-1, text=True)
    lingering = WatchedProcess([sys.executable, "-c", leaving_then("time.sleep(600)")], stderr=-1, text=True)
    silent = WatchedProcess([sys.executable, "-c", "import time; time.sleep(600)"])
    for p in (prompt, late):
        p.communicate(timeout=60)
    time.sleep(1.0)  # the lingering one has logged its line by now
    assert set(take_watched()) == {prompt, late, lingering, silent}  # judged here, not by the autouse fixture
    problems = {p.who.split()[1]: p for p in judge_watched([prompt, late, lingering, silent], bound=1.0)}
    assert str(prompt.pid) not in problems
    assert problems[str(late.pid)].what.startswith("ended "), problems
    assert float(problems[str(late.pid)].what.split()[1].rstrip("s")) >= 2.0, problems
    assert problems[str(lingering.pid)].what.startswith("still running"), problems
    assert any("leaving with exit code 0" in line for line in problems[str(lingering.pid)].tail)
    assert "still running at the end of the test" in problems[str(silent.pid)].what
    assert lingering.poll() is not None and silent.poll() is not None  # killed by the check


def test_pods_that_linger_or_leave_processes_behind_are_reported(local_cluster: LocalCluster,
                                                                   k8s_namespace: str) -> None:
    from test_local_kubelet import pod_manifest

    ns = k8s_namespace
    # The cluster's own follower, the one the autouse fixture asks: what it reports here is settled, so the
    # deliberate problems below are not reported again after the test.
    check = follow(local_cluster.dir)
    scripts = {
        "prompt": leaving_then("pass"),
        "lingering": leaving_then("time.sleep(600)"),
        "orphaning": leaving_then("subprocess.Popen(['sleep', '600']); time.sleep(0.5)"),
    }
    for name, script in scripts.items():
        local_cluster.kubectl("apply", "-f", "-", input=pod_manifest(name, ns, script, grace=1))
    # A shell runs the process that logs and stays after it (as the operator's lingering-pod test does).
    wrapped = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "wrapped", "namespace": ns},
               "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [
                   {"name": "main", "image": "local/python", "command": ["sh", "-c", 'python3 -c "$S"; exec sleep 600'],
                    "env": [{"name": "S", "value": leaving_then("pass")}]}]}}
    local_cluster.kubectl("apply", "-f", "-", input=json.dumps(wrapped))
    wait_until(lambda: phase_is(local_cluster, ns, "prompt", "Succeeded"), "the prompt pod to succeed")
    wait_until(lambda: phase_is(local_cluster, ns, "orphaning", "Succeeded"), "the orphaning pod to succeed")
    for name in ("lingering", "wrapped"):
        wait_until(lambda name=name: "leaving with exit code" in local_cluster.kubectl("-n", ns, "logs", name).stdout,
                   f"the {name} pod's exit line")
    problems = check.judge(bound=1.0)
    try:
        mine = [p for p in problems if f"pod {ns}/" in p.who]
        assert len(mine) == len(problems), [str(p) for p in problems]  # another test's process, if any
        by_pod = {p.who.split()[1].split("/")[1]: p for p in mine}
        assert set(by_pod) == {"lingering", "orphaning"}, [str(p) for p in problems]
        assert by_pod["lingering"].what.startswith("still running"), str(by_pod["lingering"])
        assert any("leaving with exit code 0" in line for line in by_pod["lingering"].tail)
        assert "left processes behind" in by_pod["orphaning"].what, str(by_pod["orphaning"])
        ended = {r["pod"] for r in read_book(Path(local_cluster.dir) / BOOK)[0]
                 if r.get("namespace") == ns and r["event"] == "ended"}
        assert {"prompt", "orphaning"} <= ended
    finally:
        # Ended now, a second or two after its line: within the autouse fixture's bound.
        for name in ("lingering", "wrapped"):
            local_cluster.kubectl("-n", ns, "delete", "pod", name, "--grace-period=0", "--force", check=False)
        wait_until(lambda: "lingering" in {r["pod"] for r in read_book(Path(local_cluster.dir) / BOOK)[0]
                                           if r.get("namespace") == ns and r["event"] == "ended"},
                   "the lingering pod's end")
