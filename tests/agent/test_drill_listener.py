"""The agent's drill listener in a real etcd: a request is carried out at most once, and answers grant no
lease of their own (issue 31, finding 7)."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from stalwart.agent.drill import DrillListener, Target
from stalwart.api.drill import DrillRequest, DrillResult
from stalwart.api.job_record import JobRecord
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store, StoreError

pytestmark = pytest.mark.integration

TOKEN = "the-job-token"


def _listener(store: Store, keys: JobKeys, carried: list[int]) -> DrillListener:
    settings = SimpleNamespace(keys=keys, node_id="node-0", job_uid=keys.uid,
                               rpc_token=SimpleNamespace(get_secret_value=lambda: TOKEN))

    def targets() -> list[Target]:
        carried.append(1)  # each carrying out looks its target up once
        return []  # no live process: the answer says so, and nothing is signalled

    return DrillListener(store, settings, targets, context="test")  # type: ignore[arg-type]


def _request(keys: JobKeys) -> DrillRequest:
    now = time.time()
    return DrillRequest(id=uuid.uuid4().hex, job_uid=keys.uid, node_id="node-0", local_rank=0, kind="rank-kill",
                        issued=now, expires=now + 120).signed(TOKEN.encode())


def _enable(store: Store, keys: JobKeys) -> None:
    record = JobRecord(job_name="j", namespace="test", uid=keys.uid, members=["node-0"], min_nodes=1, max_nodes=1,
                       nproc_per_node=1, join_timeout_seconds=90, last_call_seconds=3, lease_ttl_seconds=1,
                       max_restarts=3, soft_timeout_seconds=10, hard_timeout_seconds=20,
                       barrier_timeout_seconds=30, backoff_limit=2, fault_injection=True)
    store.put(keys.job, record.to_json_bytes())


def test_a_request_read_again_after_its_answer_was_lost_is_not_carried_out_twice(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    _enable(store, keys)
    carried: list[int] = []
    listener = _listener(store, keys, carried)
    req = _request(keys)
    real_put = store.put
    failed: list[str] = []

    def put_failing_once(key: str, value: bytes, **kw: Any) -> int:
        if key == keys.drill_result(req.id) and not failed:
            failed.append(key)
            raise StoreError("etcd unreachable")
        return real_put(key, value, **kw)

    monkeypatch.setattr(store, "put", put_failing_once)
    listener._on_request(req.to_json_bytes())  # carried out; its answer is lost
    assert carried == [1] and failed and store.get(keys.drill_result(req.id)) is None
    listener._on_request(req.to_json_bytes())  # the watch reconnects and reads the request again
    assert carried == [1]  # not carried out again
    kv = store.get(keys.drill_result(req.id))
    assert kv is not None
    answer = DrillResult.from_json_bytes(kv.value)
    assert (answer.accepted, answer.reason) == (False, "local rank 0 has no live process on this pod")


def test_answers_share_one_lease(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    carried: list[int] = []
    listener = _listener(store, keys, carried)
    grants: list[int] = []
    real_grant = store.lease_grant

    def counting_grant(ttl: int, **kw: Any) -> int:
        grants.append(ttl)
        return real_grant(ttl, **kw)

    monkeypatch.setattr(store, "lease_grant", counting_grant)
    requests = [_request(keys).model_copy(update={"signature": "0" * 64}) for _ in range(5)]  # forged: refused
    for r in requests:
        listener._on_request(r.to_json_bytes())
    assert carried == []
    leases = set()
    for r in requests:
        kv = store.get(keys.drill_result(r.id))
        assert kv is not None and "not signed with the job's token" in DrillResult.from_json_bytes(kv.value).reason
        leases.add(kv.lease)
    assert len(grants) == 1 and len(leases) == 1  # five answers, one lease
