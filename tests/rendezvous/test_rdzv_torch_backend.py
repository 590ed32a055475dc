"""torch's RendezvousBackend contract on etcd v3, torch's own handler on it, and torchrun with real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from stalwart.agent.rendezvous.torch_backend import BACKEND_NAME, EtcdV3RendezvousBackend, register
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration

TRAIN = Path(__file__).with_name("torchrun_script.py")
SECRET = b"the-run-secret-0123456789"


@pytest.fixture
def backend(store: Store, prefix: str) -> EtcdV3RendezvousBackend:
    return EtcdV3RendezvousBackend(store, prefix + "state", secret=SECRET)


def test_set_state_is_a_compare_and_set_on_the_fencing_token(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.name == BACKEND_NAME
    assert backend.get_state() is None
    state, token, ok = backend.set_state(b"\x00one")  # type: ignore[misc]
    assert (state, ok) == (b"\x00one", True)
    assert backend.get_state() == (b"\x00one", token)
    # token None: only if absent; the existing state and token come back.
    assert backend.set_state(b"two", None) == (b"\x00one", token, False)
    # the right token: written, with a new token.
    state2, token2, ok2 = backend.set_state(b"two", token)  # type: ignore[misc]
    assert (state2, ok2) == (b"two", True) and token2 != token
    # a stale token: nothing written, the current state and token come back.
    assert backend.set_state(b"three", token) == (b"two", token2, False)
    # a token this backend never handed out cannot match.
    assert backend.set_state(b"three", b"bogus") == (b"two", token2, False)
    assert backend.get_state() == (b"two", token2)


def test_set_state_with_a_token_after_the_state_is_gone_returns_none(
        backend: EtcdV3RendezvousBackend, store: Store) -> None:
    _, token, _ = backend.set_state(b"s")  # type: ignore[misc]
    store.delete(backend.key)
    assert backend.set_state(b"s2", token) is None
    assert backend.get_state() is None


def test_corrupt_state_raises_rendezvous_state_error(backend: EtcdV3RendezvousBackend, store: Store) -> None:
    store.put(backend.key, b"\x80\x04 not json")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    store.put(backend.key, b'{"format": "torch-dynamic-rendezvous/v1", "state": "***"}')
    with pytest.raises(RendezvousStateError, match="base64"):
        backend.get_state()
    store.put(backend.key, b'{"format": "other", "state": ""}')
    with pytest.raises(RendezvousStateError, match="format"):
        backend.set_state(b"x", None)
    with pytest.raises(RendezvousStateError, match="too large"):
        backend.set_state(b"x" * 300_000, None)


def test_connection_failure_raises_rendezvous_connection_error(private_etcd: EtcdServer) -> None:
    store = Store([private_etcd.endpoint], timeout=1.0)
    try:
        b = EtcdV3RendezvousBackend(store, "/test/conn/state", secret=SECRET)
        private_etcd.stop()
        with pytest.raises(RendezvousConnectionError):
            b.get_state()
        with pytest.raises(RendezvousConnectionError):
            b.set_state(b"x")
        private_etcd.start()
    finally:
        store.close()


def test_torch_dynamic_handler_runs_on_etcd_v3_through_the_registry(etcd: EtcdServer, tmp_path: Path) -> None:
    register()
    (tmp_path / "secret").write_bytes(SECRET)
    run_id = f"threads-{uuid.uuid4().hex[:8]}"
    n = 3
    results: dict[int, object] = {}
    done = threading.Barrier(n, timeout=120)

    def node(i: int) -> None:
        params = RendezvousParameters(backend=BACKEND_NAME, endpoint=etcd.endpoint, run_id=run_id,
                                      min_nodes=n, max_nodes=n, join_timeout="60", last_call_timeout="1",
                                      local_addr="127.0.0.1", hmac_key_file=str(tmp_path / "secret"))
        handler = get_rendezvous_handler(params)
        try:
            info = handler.next_rendezvous()
            results[i] = (info.rank, info.world_size)
        except Exception as e:
            results[i] = e
        finally:
            done.wait()  # shutdown closes the rendezvous: only once every node is through
            handler.shutdown()

    threads = [threading.Thread(target=node, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(map(str, results.values())) == [str((r, n)) for r in range(n)], results


def test_torchrun_with_the_stalwart_etcd_backend(etcd: EtcdServer, tmp_path: Path) -> None:
    """Two torchrun agents (separate processes) rendezvous on etcd v3 and run a gloo all-reduce."""
    run_id = f"torchrun-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OUT_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1", "STALWART_RPC_TOKEN": SECRET.decode()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           f"--rdzv-backend={BACKEND_NAME}", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}",
           "--rdzv-conf=join_timeout=120,last_call_timeout=1", "--local-addr=127.0.0.1",
           "--monitor-interval=0.5", str(TRAIN)]
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
              for _ in range(2)]
    outputs = []
    for a in agents:
        out, _ = a.communicate(timeout=240)
        outputs.append(out.decode(errors="replace"))
    assert [a.returncode for a in agents] == [0, 0], "\n-----\n".join(o[-3000:] for o in outputs)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    assert {r["world_size"] for r in reports} == {4}
    assert {r["sum"] for r in reports} == {10.0}


class _Payload:
    """Unpickling this runs ``os.mkdir(path)``: the proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (self.path,)


def test_a_tampered_state_is_refused_before_torch_unpickles_it(etcd: EtcdServer, store: Store, prefix: str,
                                                                tmp_path: Path) -> None:
    import base64
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from stalwart.api.rendezvous import TorchRendezvousState
    from stalwart.etcd.torch_store import EtcdTorchStore

    backend = EtcdV3RendezvousBackend(store, prefix + "state", secret=SECRET)
    forger = EtcdV3RendezvousBackend(store, prefix + "state", secret=b"not-the-run-secret-at-all")
    marker = tmp_path / "unpickled"
    evil = pickle.dumps(_Payload(str(marker)))
    # Signed with another secret (what anyone with write access to etcd but not the secret could do).
    forger.set_state(evil, None)
    with pytest.raises(RendezvousStateError, match="fails its signature check"):
        backend.get_state()
    # A genuine record whose state bytes were swapped afterwards.
    store.delete(backend.key)
    _, token, ok = backend.set_state(b"genuine", None) or (None, None, False)
    assert ok and backend.get_state() == (b"genuine", token)
    kv = store.get(backend.key)
    assert kv is not None
    envelope = TorchRendezvousState.from_json_bytes(kv.value)
    store.put(backend.key, envelope.model_copy(update={"state": base64.b64encode(evil).decode()}).to_json_bytes())
    with pytest.raises(RendezvousStateError, match="fails its signature check"):
        backend.set_state(b"next", token)  # the compare fails, and the current value read back is refused
    # torch's own handler on the tampered state: it stops at the refusal and nothing was unpickled.
    params = RendezvousParameters(backend=BACKEND_NAME, endpoint=etcd.endpoint, run_id="tampered", min_nodes=1,
                                  max_nodes=1, join_timeout="10", local_addr="127.0.0.1")
    handler = create_handler(EtcdTorchStore.unfenced(store, prefix + "store/", timeout=10), backend, params)
    with pytest.raises(RendezvousStateError, match="fails its signature check"):
        handler.next_rendezvous()
    assert not marker.exists()


def test_the_backend_needs_the_runs_secret(etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.agent.rendezvous.torch_backend import create_backend

    monkeypatch.delenv("STALWART_RPC_TOKEN", raising=False)
    params = RendezvousParameters(backend=BACKEND_NAME, endpoint=etcd.endpoint, run_id="r", min_nodes=1,
                                  max_nodes=1)
    with pytest.raises(ValueError, match="hmac_key_file: the stalwart-etcd backend signs"):
        create_backend(params)


# -- one key per purpose; the MAC covers the key's version (issue 31, finding 9) ------------------------------


def test_an_older_signed_state_put_back_is_refused(backend: EtcdV3RendezvousBackend, store: Store) -> None:
    _, token, _ = backend.set_state(b"first", None)  # type: ignore[misc]
    old = store.get(backend.key)
    assert old is not None
    _, token2, ok = backend.set_state(b"second", token)  # type: ignore[misc]
    assert ok
    store.put(backend.key, old.value)  # whoever may write the key replays the older, genuinely signed state
    with pytest.raises(RendezvousStateError, match="fails its signature check"):
        backend.get_state()
    kv = store.get(backend.key)
    assert kv is not None and kv.value == old.value  # and the backend wrote nothing over it
    with pytest.raises(RendezvousStateError, match="fails its signature check"):
        backend.set_state(b"third", token2)
    kv = store.get(backend.key)
    assert kv is not None and kv.value == old.value


def test_the_state_is_signed_with_its_own_key_not_the_jobs_token(backend: EtcdV3RendezvousBackend,
                                                                  store: Store) -> None:
    import hashlib
    import hmac as hmac_

    from stalwart.api.rendezvous import TorchRendezvousState

    backend.set_state(b"s", None)
    kv = store.get(backend.key)
    assert kv is not None
    envelope = TorchRendezvousState.from_json_bytes(kv.value)
    # A MAC made with the job's token itself (as a drill request's or an RPC peer's holder could) does not verify.
    raw = hmac_.new(SECRET, b"\0".join([backend.key.encode(), envelope.format.encode(), b"1", b"s"]),
                    hashlib.sha256).hexdigest()
    assert envelope.mac != raw
