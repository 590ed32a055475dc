"""``stalwart drill`` against the demo's job on the local cluster: a few faults through the Kubernetes API and
through the job's agents, each recovered and reported; and the refusals: a request without the job's token, and
any agent fault once the job no longer opts in."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid

import pytest
import yaml
from e2e_jobs import NAMESPACE, REPO, delete, status, wait_for, wait_phase

from stalwart.api.job_record import JobRecord
from stalwart.demo import EXAMPLE, DemoOptions, Installation, demo_job
from stalwart.drill.session import DrillOptions, DrillSession, Refused

pytestmark = pytest.mark.e2e


def drill_job(name: str) -> dict[str, object]:
    """The job ``stalwart demo`` runs (without its own injected faults), long enough for a drill, opted in."""
    job = demo_job(yaml.safe_load(EXAMPLE.read_text()),
                   DemoOptions(directory=REPO, steps=100_000, step_delay=0.05, fail_at_step=99_998,
                               kill_at_step=99_999))
    job["metadata"]["name"] = name
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if not e["name"].startswith("STALWART_EXAMPLE_FAIL")]
    job["spec"]["faultInjection"] = {"enabled": True}
    # Warm spares off: the counters asserted below are those of process restart at a pod loss (the drill is
    # what is tested here; in-process pod loss, this job's default, is tested in tests/operator/test_warm_spares.py).
    job["spec"].setdefault("restartPolicy", {}).setdefault("inProcess", {})["warmSpares"] = False
    return job


def test_drill_against_the_demo_job(stalwart_install: Installation, tmp_path: object) -> None:
    cluster = stalwart_install.cluster
    name = f"drill-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(drill_job(name)))
    try:
        wait_phase(cluster, name, "Running", timeout=240)
        env = {**os.environ, **cluster.env()}
        result = subprocess.run(
            [sys.executable, "-m", "stalwart", "drill", name, "-n", NAMESPACE, "--faults", "3",
             "--kinds", "rank-exception,rank-kill,pod-delete", "--seed", "3", "--timeout", "180"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
        out = result.stdout
        assert result.returncode == 0, f"{out}\n{result.stderr[-3000:]}"
        rows = [line for line in out.splitlines() if line[:1].isdigit() and " of " not in line]
        assert len(rows) == 3, out
        assert {row.split()[1] for row in rows} == {"rank-exception", "rank-kill", "pod-delete"}, out
        for row in rows:
            # Seconds to recovery (within the drill's bound), steps recomputed, and what the status said.
            m = re.search(r"\s(\d+\.\d)s\s+(\d+)\s+Running; restarts", row)
            assert m is not None and float(m.group(1)) < 180, row
            assert "lastFailure" in row, row
        by_kind = {row.split()[1]: row for row in rows}
        assert "lastFailure Exception DrillFault (rank" in by_kind["rank-exception"], out
        assert "lastFailure ProcessExited SIGKILL (rank" in by_kind["rank-kill"], out
        assert "lastFailure PodLost (" in by_kind["pod-delete"], out
        assert "3 of 3 fault(s) recovered" in out
        st = status(cluster, name)
        assert st["restarts"] == {"inProcess": 1, "processRestarts": 2, "podReplacements": 1}, st
        assert st["totalRestarts"] == 3

        # Refusals. A request signed with anything but the job's token changes nothing.
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(cluster.kubeconfig),  # type: ignore[no-untyped-call]
                                client_configuration=cfg)
        session = DrillSession(client.ApiClient(cfg), NAMESPACE, name, [str(cluster.etcd_endpoint)],
                               DrillOptions(timeout=60))
        try:
            session.connect()
            point = wait_for("a rank in its training function", lambda: next(
                (p for p in session.current_points() if p.state == "running"), None), timeout=120)
            with pytest.raises(Refused, match="not signed with the job's token"):
                session.agent_fault("rank-kill", point.node, point.local_rank, token=b"not-the-job-token")
            time.sleep(3.0)
            assert status(cluster, name)["restarts"] == st["restarts"]
            # Without the opt-in, even a correctly signed request is refused.
            cluster.kubectl("patch", "tj", name, "-n", NAMESPACE, "--type=merge",
                            "-p", json.dumps({"spec": {"faultInjection": {"enabled": False}}}))
            wait_for("the job's record in etcd to follow its spec", lambda: not _opted_in(session), timeout=60)
            with pytest.raises(Refused, match="fault injection is not enabled for this job"):
                session.agent_fault("rank-exception", point.node, point.local_rank)
        finally:
            session.close()
            session.api.close()
        result = subprocess.run(
            [sys.executable, "-m", "stalwart", "drill", name, "-n", NAMESPACE, "--faults", "1",
             "--kinds", "rank-exception", "--timeout", "60"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "fault injection is not enabled for this job" in result.stderr
        assert status(cluster, name)["restarts"] == st["restarts"]
    finally:
        delete(cluster, name)


def _opted_in(session: DrillSession) -> bool:
    kv = session._store().get(session.keys.job)
    return kv is not None and JobRecord.from_json_bytes(kv.value).fault_injection
