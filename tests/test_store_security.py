"""etcd over TLS with authentication on: logins, one user per job, token renewal, and refusals that name
their cause and write nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.api.pod_env import PodEnvError
from stalwart.etcd.admin import JobLogin, delete_job_login, ensure_job_login, job_user_name
from stalwart.etcd.client import CredentialsError, EtcdCredentials, connect
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store, StorePermissionDenied, StoreSecurityError, StoreUnavailable
from stalwart.local.etcd import EtcdServer
from stalwart.local.etcd_pki import LocalCA

pytestmark = pytest.mark.integration


@pytest.fixture
def root(secure_etcd: EtcdServer) -> Iterator[Store]:
    with connect([secure_etcd.endpoint], secure_etcd.credentials()) as store:
        yield store


def _job(root: Store) -> tuple[JobKeys, JobLogin]:
    keys = JobKeys("team", uuid.uuid4().hex[:12])
    return keys, ensure_job_login(root, keys, uuid.uuid4().hex)


def _nothing_under(root: Store, keys: JobKeys) -> None:
    assert root.get_prefix(keys.prefix)[0] == []


def test_job_user_reads_and_writes_its_prefix_only(secure_etcd: EtcdServer, root: Store) -> None:
    (a, login_a), (b, login_b) = _job(root), _job(root)
    root.put(b.prefix + "job", b"B's record")
    with connect([secure_etcd.endpoint], secure_etcd.credentials(login_a.user, login_a.password),
                 probe=a.prefix) as store_a:
        store_a.put(a.prefix + "job", b"A's record")
        assert store_a.get(a.prefix + "job") is not None
        with pytest.raises(StorePermissionDenied, match="no permission"):
            store_a.get(b.prefix + "job")
        with pytest.raises(StorePermissionDenied):
            store_a.put(b.prefix + "job", b"forged")
        with pytest.raises(StorePermissionDenied):
            store_a.delete_prefix(b.prefix)
        with pytest.raises(StorePermissionDenied):
            store_a.watch(b.prefix, prefix=True)
        with pytest.raises(StorePermissionDenied):
            store_a.put("/stalwart/v1/other", b"outside every job")
    kv = root.get(b.prefix + "job")
    assert kv is not None and kv.value == b"B's record" and kv.version == 1
    # Job B's user is refused at connect when it is pointed at job A's prefix.
    with pytest.raises(StorePermissionDenied):
        connect([secure_etcd.endpoint], secure_etcd.credentials(login_b.user, login_b.password), probe=a.prefix)


def test_refusals_name_their_cause_and_write_nothing(secure_etcd: EtcdServer, root: Store) -> None:
    keys, login = _job(root)
    ep = [secure_etcd.endpoint]
    right = secure_etcd.credentials(login.user, login.password)
    with pytest.raises(StoreSecurityError, match="needs a login"):
        connect(ep, secure_etcd.credentials(user="", password=""), probe=keys.prefix)
    with pytest.raises(StoreSecurityError, match="username or password is wrong"):
        connect(ep, right.with_login(login.user, "not-the-password"), probe=keys.prefix)
    with pytest.raises(StoreSecurityError, match="username or password is wrong"):
        connect(ep, right.with_login("nobody", login.password), probe=keys.prefix)
    wrong_ca = EtcdCredentials(tls=True, user=login.user, password=login.password,
                               ca_cert=LocalCA("some-other-ca").cert_pem, client_cert=right.client_cert,
                               client_key=right.client_key)
    with pytest.raises(StoreSecurityError, match=r"TLS handshake .* failed: check ca\.crt"):
        connect(ep, wrong_ca, probe=keys.prefix)
    with pytest.raises(StoreUnavailable):  # plaintext against a TLS-only listener
        connect(ep, EtcdCredentials(user=login.user, password=login.password), probe=keys.prefix, timeout=2)
    _nothing_under(root, keys)


def test_token_is_renewed_past_its_ttl(secure_etcd: EtcdServer, root: Store) -> None:
    keys, login = _job(root)
    assert secure_etcd.auth_token_ttl is not None
    with connect([secure_etcd.endpoint], secure_etcd.credentials(login.user, login.password)) as store:
        lease = store.lease_grant(2)
        watch = store.watch(keys.prefix, prefix=True)
        store.put(keys.prefix + "a", b"1")
        assert store.token_renewals == 0
        time.sleep(secure_etcd.auth_token_ttl + 2)  # the token is unused (the keep-alive renews it or not)
        store.put(keys.prefix + "b", b"2")
        store.txn([], [])
        # The keep-alive thread may have been the one to notice; either way the store logged in again.
        assert store.token_renewals >= 1
        assert store.lease_ttl(lease) > 0, "the lease outlived the token"
        events = [watch.next(5.0), watch.next(5.0)]
        assert [e.kv.key for e in events if e is not None] == [keys.prefix + "a", keys.prefix + "b"]
        watch.cancel()
    assert [kv.key for kv in root.get_prefix(keys.prefix)[0]] == [keys.prefix + "a", keys.prefix + "b"]


def test_the_operator_turns_authentication_on_where_it_is_off(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd", tls=True) as server:
        root = server.credentials().with_login("root", "the-root-password")
        with pytest.raises(StoreSecurityError, match="authentication off"):
            connect([server.endpoint], root)
        with connect([server.endpoint], root, enable_auth=True) as store:
            store.put("/stalwart/v1/x", b"1")
        with connect([server.endpoint], root, enable_auth=True) as store:  # on already: a plain login
            assert store.get("/stalwart/v1/x") is not None
        with pytest.raises(StoreSecurityError, match="needs a login"):
            connect([server.endpoint], server.credentials(), probe="/stalwart/v1/")


def test_deleted_job_login_is_refused(secure_etcd: EtcdServer, root: Store) -> None:
    keys, login = _job(root)
    delete_job_login(root, keys)
    delete_job_login(root, keys)  # idempotent
    with pytest.raises(StoreSecurityError, match="username or password is wrong"):
        connect([secure_etcd.endpoint], secure_etcd.credentials(login.user, login.password))
    assert job_user_name(keys).endswith(keys.uid)


def test_credentials_from_a_mounted_secret(secure_etcd: EtcdServer, root: Store, tmp_path: Path) -> None:
    keys, login = _job(root)
    creds = secure_etcd.credentials(login.user, login.password)
    secret = tmp_path / "secret"
    secret.mkdir()
    for name, data in {"ca.crt": creds.ca_cert, "tls.crt": creds.client_cert, "tls.key": creds.client_key,
                       "username": login.user.encode(), "password": login.password.encode()}.items():
        assert data is not None
        (secret / name).write_bytes(data)
    env = creds.to_env(secret)
    assert login.password not in "".join(env.values())
    with connect([secure_etcd.endpoint], EtcdCredentials.from_env(env), probe=keys.prefix) as store:
        store.put(keys.prefix + "k", b"v")
    (secret / "ca.crt").unlink()
    with pytest.raises(CredentialsError, match=r"ca\.crt: required with TLS"):
        EtcdCredentials.from_env(env)


@pytest.mark.parametrize(("env", "error", "message"), [
    ({"STALWART_ETCD_TLS": "maybe"}, PodEnvError, "STALWART_ETCD_TLS: Input should be a valid boolean"),
    ({"STALWART_ETCD_TLS": "true"}, PodEnvError,
     "STALWART_ETCD_SECRET_DIR: required when STALWART_ETCD_TLS is true"),
    ({"STALWART_ETCD_SECRET_DIR": "/nonexistent/dir"}, CredentialsError, "is not a directory"),
])
def test_credentials_env_errors_name_the_variable(env: dict[str, str], error: type[ValueError], message: str) -> None:
    with pytest.raises(error, match=message):
        EtcdCredentials.from_env(env)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tls": True}, r"ca\.crt: required with TLS"),
    ({"tls": True, "ca_cert": b"x", "client_cert": b"c"}, r"tls\.crt/tls\.key"),
    ({"user": "u"}, "username/password: a login needs both"),
    ({"ca_cert": b"x"}, "TLS is off"),
])
def test_credentials_must_be_whole(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CredentialsError, match=message):
        EtcdCredentials(**kwargs)  # type: ignore[arg-type]


def test_no_credentials_means_plaintext() -> None:
    assert EtcdCredentials.from_env({}) == EtcdCredentials()
