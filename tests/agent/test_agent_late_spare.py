"""A pod that joins a running job after a loss (a lost pod's replacement) starts its fork server, and so its
parked processes, only once the round's ranks have stepped, not beside the recovered round's first step (the
costliest): real etcd, two agents (pods) of one rank each, real torch ranks (bench/restart_ddp.py), a second
round forced as a loss would force it, and a spare agent started in that round."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from test_agent import agents_end, ended_ok, start_agent  # puts tests/restart on the path

from restart_helpers import wait_until  # isort: skip

from stalwart.api.rendezvous import Manifest, RerendezvousRequest
from stalwart.etcd.keys import MANIFEST, REQUEST, JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration

#: 0.1 s a step: long enough, after the second round's seal, for the spare to see both workers step.
STEPS = 150


def round_of_both(store: Store, keys: JobKeys) -> tuple[int, int] | None:
    """The (round, epoch) of the sealed round, once it names both workers as members."""
    kv = store.get(keys.rendezvous + MANIFEST)
    if kv is None:
        return None
    manifest = Manifest.from_json_bytes(kv.value)
    if any(manifest.member(f"job-worker-{i}") is None for i in range(2)):
        return None
    return manifest.round, kv.mod_revision


def test_a_pod_that_joins_after_a_loss_starts_nothing_until_the_round_stepped(etcd: EtcdServer,
                                                                              tmp_path: Path) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    agents = [start_agent(etcd, tmp_path, "--steps", str(STEPS), "--step-sleep", "0.1", keys=keys,
                          pod=f"job-worker-{i}", nproc=1, nodes=2, agent_args=("--warm-spares", "--no-standby"))[0]
              for i in range(2)]
    with agents_end(agents), Store([etcd.endpoint]) as store:
        wait_until("a round of both workers", lambda: round_of_both(store, keys), timeout=240)
        first = round_of_both(store, keys)
        assert first is not None
        # A new round in place of the first, as a loss would bring (the workers keep their processes: warm spares).
        store.put(keys.rendezvous + REQUEST, RerendezvousRequest(
            epoch=first[1], node_id="job-worker-0", reason="injected: a round after a loss").to_json_bytes())
        wait_until("the second round", lambda: (r := round_of_both(store, keys)) is not None and r[0] > first[0],
                   timeout=120)
        spare, _ = start_agent(etcd, tmp_path, "--steps", str(STEPS), keys=keys, pod="job-spare-0", nproc=1,
                               nodes=2, agent_args=("--warm-spares",), extra_env={"STALWART_SPARE": "true"})
        agents.append(spare)
        errs = [err for _, err in ended_ok(agents)]
    err = errs[2]
    assert "joining a running job" in err, err[-3000:]
    # The fork server started after both workers' ranks were seen to step in the round (or, on a machine so loaded
    # that they did not within 30 s, after that limit), not at the agent's start.
    why = max(err.find("every member's ranks stepped in the round"), err.find("reported no second step in 30 s"))
    assert 0 <= why < err.find("fork server started"), err[-3000:]
