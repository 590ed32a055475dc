"""A zombie RPC worker (its process paused across a new round) changes nothing of the newer round.

Run as a script, this file is the zombie: it registers ``worker1`` in the round of epoch 5, says ``ready``,
and when told ``go`` on stdin (after the test paused it with SIGSTOP, started the next round and resumed it)
tries to register again and closes (which removes its record), then prints what happened as JSON.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid

import pytest

from stalwart.api.rpc import RpcWorkerRecord
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer
from stalwart.rpc import EtcdMembership, Worker
from stalwart.rpc.membership import Fenced

pytestmark = pytest.mark.integration


def _record(epoch: int, incarnation: str) -> RpcWorkerRecord:
    return RpcWorkerRecord(name="worker1", rank=1, address="127.0.0.1:1001", epoch=epoch, incarnation=incarnation)


@pytest.mark.parametrize(("current", "mine", "allowed"), [
    (None, 5, True),
    (5, 5, True),   # a rank process respawned within its round
    (5, 9, True),   # the next round's worker replaces the last round's
    (9, 5, False),  # a zombie of an older round
])
def test_who_may_replace_a_worker_record(current: int | None, mine: int, allowed: bool) -> None:
    held = None if current is None else _record(current, "held")
    assert _record(mine, "mine").may_replace(held) is allowed


def zombie_main(endpoint: str, namespace: str, uid: str, epoch: str) -> int:
    with Store([endpoint]) as store:
        membership = EtcdMembership(store, JobKeys(namespace, uid), epoch=int(epoch), lease_ttl=60)
        membership.register(Worker("worker1", 1, "127.0.0.1:1001", "zombie"), node="node-old")
        print("ready", flush=True)
        sys.stdin.readline()
        try:
            membership.register(Worker("worker1", 1, "127.0.0.1:1001", "zombie"), node="node-old")
            outcome = "registered"
        except Fenced as e:
            outcome = f"fenced: {e}"
        membership.close()
        print(json.dumps({"register": outcome}), flush=True)
    return 0


def test_a_paused_worker_of_an_older_round_is_fenced_and_the_live_one_untouched(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as store:
        old = store.put(keys.manifest, b"{}")
    zombie = subprocess.Popen([sys.executable, __file__, etcd.endpoint, keys.namespace, keys.uid, str(old)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert zombie.stdout is not None and zombie.stdin is not None
        assert zombie.stdout.readline().strip() == "ready"
        zombie.send_signal(signal.SIGSTOP)
        with Store([etcd.endpoint]) as store:
            new = store.put(keys.manifest, b"{}")
            live = EtcdMembership(store, keys, epoch=new, lease_ttl=60)
            try:
                live.register(Worker("worker1", 1, "127.0.0.1:2002", "live"), node="node-new")
                zombie.send_signal(signal.SIGCONT)
                zombie.stdin.write("go\n")
                zombie.stdin.flush()
                out, _ = zombie.communicate(timeout=60)
                result = json.loads(out.strip().splitlines()[-1])
                assert result["register"].startswith(f"fenced: RPC worker 'worker1' of the round of epoch {old} "
                                                     "is fenced")
                kv = store.get(keys.rpc + "workers/worker1")
                assert kv is not None and kv.lease == live.lease
                record = RpcWorkerRecord.from_json_bytes(kv.value)
                assert (record.epoch, record.incarnation, record.address) == (new, "live", "127.0.0.1:2002")
            finally:
                live.close()
    finally:
        if zombie.poll() is None:
            zombie.send_signal(signal.SIGCONT)
            zombie.kill()
            zombie.wait(10)


def test_close_removes_only_its_own_record(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as store:
        old_lease, new_lease = store.lease_grant(60), store.lease_grant(60)
        old = EtcdMembership(store, keys, epoch=store.put(keys.manifest, b"{}"), lease=old_lease)
        old.register(Worker("worker1", 1, "127.0.0.1:1001", "old"))
        new = EtcdMembership(store, keys, epoch=store.put(keys.manifest, b"{}"), lease=new_lease)
        try:
            new.register(Worker("worker1", 1, "127.0.0.1:2002", "new"))
            old.close()  # a shared lease: close deletes the record, but only while it is still its own
            kv = store.get(keys.rpc + "workers/worker1")
            assert kv is not None and RpcWorkerRecord.from_json_bytes(kv.value).incarnation == "new"
        finally:
            new.close()
            store.lease_revoke(old_lease)
            store.lease_revoke(new_lease)


if __name__ == "__main__":
    sys.exit(zombie_main(*sys.argv[1:5]))
