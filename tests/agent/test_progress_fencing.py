"""An agent paused across a new round (a zombie) changes nothing of the newer round's progress records.

Run as a script, this file is the zombie: its reporter joins the round of the epoch it is given, writes its
record, says ``ready``, and when told ``go`` on stdin (after the test paused it with SIGSTOP, sealed the next
round and resumed it) tries to write again, then prints what happened as JSON.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid

import pytest

from stalwart.agent.progress import ProgressBook, ProgressReporter, joined, write_guard
from stalwart.api.restart import ProgressRecord
from stalwart.etcd.fence import Fence, StaleEpoch
from stalwart.etcd.keys import MANIFEST, NODES, JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

NODE = "job-worker-0"


@pytest.mark.parametrize(("epoch", "fence_epoch", "refused", "expected"), [
    (0, None, 0, "plain"),   # never joined a round: the record holds no round's facts
    (7, 7, 0, "fenced"),     # a round's record goes through that round's fence
    (7, None, 0, "hold"),    # no fence of the round: nothing is written
    (9, 7, 0, "hold"),       # a fence of another round cannot fence this one
    (7, 7, 7, "hold"),       # the round refused a write already: it is over
    (9, 9, 7, "fenced"),     # a new round after a refused one
])
def test_how_a_record_may_be_written(epoch: int, fence_epoch: int | None, refused: int, expected: str) -> None:
    book = ProgressBook(node_id=NODE, incarnation="i0")
    if epoch:
        book = joined(book, 1, epoch)
    assert write_guard(book, fence_epoch, refused) == expected


def _seal(store: Store, keys: JobKeys, round_: int) -> int:
    """Seal a round (the manifest key's mod_revision is its epoch)."""
    return store.put(keys.rendezvous + MANIFEST, json.dumps({"round": round_}).encode())


def _register(store: Store, keys: JobKeys) -> tuple[int, int]:
    """Register NODE under a lease of its own: (lease, create_revision of its key)."""
    lease = store.lease_grant(60)
    store.put(keys.rendezvous + NODES + NODE, b"{}", lease=lease)
    kv = store.get(keys.rendezvous + NODES + NODE)
    assert kv is not None
    return lease, kv.create_revision


def zombie_main(endpoint: str, namespace: str, uid: str, epoch: str, revision: str) -> int:
    keys = JobKeys(namespace, uid)
    with Store([endpoint]) as store:
        reporter = ProgressReporter(store, keys, NODE, interval=0.0, context="zombie")
        reporter.join(1, int(epoch), Fence(store, keys, int(epoch), holder=(NODE, int(revision))))
        assert reporter.publish("running", force=True)
        print("ready", flush=True)
        sys.stdin.readline()
        published = reporter.publish("failed", force=True)
        again = reporter.publish("failed", force=True)
        try:
            assert reporter.fence is not None
            reporter.fence.put(reporter.key, b"{}")
            direct = "written"
        except StaleEpoch as e:
            direct = f"refused: {e}"
        print(json.dumps({"published": published, "again": again, "refused_epoch": reporter.refused_epoch,
                          "direct": direct}), flush=True)
    return 0


@pytest.mark.integration
def test_a_paused_agent_of_an_older_round_is_refused_and_the_live_record_untouched(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as store:
        old_lease, old_revision = _register(store, keys)
        old_epoch = _seal(store, keys, 1)
        zombie = subprocess.Popen([sys.executable, __file__, etcd.endpoint, keys.namespace, keys.uid,
                                   str(old_epoch), str(old_revision)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert zombie.stdout is not None and zombie.stdin is not None
            assert zombie.stdout.readline().strip() == "ready"
            zombie.send_signal(signal.SIGSTOP)
            # The operator fences the paused node (its lease revoked); its successor of the same name joins a
            # new round.
            store.lease_revoke(old_lease)
            _, new_revision = _register(store, keys)
            new_epoch = _seal(store, keys, 2)
            live = ProgressReporter(store, keys, NODE, interval=0.0, context="live")
            live.join(2, new_epoch, Fence(store, keys, new_epoch, holder=(NODE, new_revision)))
            assert live.publish("running", force=True)
            before = store.get(keys.progress + NODE)
            assert before is not None

            zombie.send_signal(signal.SIGCONT)
            zombie.stdin.write("go\n")
            zombie.stdin.flush()
            out, _ = zombie.communicate(timeout=60)
            result = json.loads(out.strip().splitlines()[-1])
            assert result["published"] is False and result["again"] is False
            assert result["refused_epoch"] == old_epoch
            assert result["direct"].startswith(f"refused: epoch {old_epoch} is stale (current epoch: {new_epoch})")

            after = store.get(keys.progress + NODE)
            assert after is not None and after.mod_revision == before.mod_revision
            rec = ProgressRecord.from_json_bytes(after.value)
            assert (rec.epoch, rec.round, rec.state, rec.incarnation) == (new_epoch, 2, "running",
                                                                          live.book.incarnation)
        finally:
            if zombie.poll() is None:
                zombie.send_signal(signal.SIGCONT)
                zombie.kill()
                zombie.wait(10)
            store.delete_prefix(keys.prefix)


if __name__ == "__main__":
    sys.exit(zombie_main(*sys.argv[1:6]))
