"""etcd users and roles: turning authentication on, and one user per job limited to that job's key prefix.

With authentication on, the operator logs in as an administrator (etcd's ``root`` role) and gives each job a
role granting read and write on ``/stalwart/v1/<namespace>/<uid>/`` and nothing else, and a user with a random
password holding only that role. The job's agents log in as that user: a job can neither read nor change
another job's rendezvous, fencing tokens or barriers. The user and role go with the job.

Every function here is idempotent (safe to repeat after a crash half-way): "already exists" on create and
"not found" on delete are not errors.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from pyetcd.etcdrpc import auth_pb2
from pyetcd.etcdrpc import rpc_pb2 as rpc

from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store, StoreError, prefix_range_end

__all__ = ["JobLogin", "delete_job_login", "enable_auth", "ensure_job_login", "job_user_name", "new_password"]

ROOT_USER = "root"
ROOT_ROLE = "root"


@dataclass(frozen=True, slots=True)
class JobLogin:
    """The etcd user of one job and its password (left out of ``repr``)."""

    user: str
    password: str = field(repr=False)


def job_user_name(keys: JobKeys) -> str:
    """The user (and role) name of a job: unique per namespace and uid, readable in ``etcdctl user list``."""
    return f"stalwart-job-{keys.namespace}-{keys.uid}"


def new_password() -> str:
    return secrets.token_urlsafe(24)


def _tolerate(store: Store, method: str, request: object, benign: str) -> None:
    try:
        store.auth(method, request)
    except StoreError as e:
        if benign not in str(e):
            raise


def enable_auth(store: Store, root_password: str) -> None:
    """Create the ``root`` user (etcd requires it) with ``root_password`` and turn authentication on.
    ``store`` must not be logged in (authentication is still off)."""
    if not root_password:
        raise ValueError("root_password: must not be empty")
    _tolerate(store, "UserAdd", rpc.AuthUserAddRequest(name=ROOT_USER, password=root_password),
              "user name already exists")
    store.auth("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=ROOT_USER, role=ROOT_ROLE))
    store.auth("AuthEnable", rpc.AuthEnableRequest())


def ensure_job_login(store: Store, keys: JobKeys, password: str) -> JobLogin:
    """Create (or bring back in line) the job's role and user; ``store`` must be logged in as an administrator.
    The role grants read/write on the job's prefix only; the user's password is set to ``password``."""
    if not password:
        raise ValueError("password: must not be empty")
    name = job_user_name(keys)
    prefix = keys.prefix.encode()
    _tolerate(store, "RoleAdd", rpc.AuthRoleAddRequest(name=name), "role name already exists")
    perm = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=prefix,
                               range_end=prefix_range_end(prefix))
    store.auth("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(name=name, perm=perm))
    try:
        store.auth("UserAdd", rpc.AuthUserAddRequest(name=name, password=password))
    except StoreError as e:
        if "user name already exists" not in str(e):
            raise
        store.auth("UserChangePassword", rpc.AuthUserChangePasswordRequest(name=name, password=password))
    store.auth("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=name, role=name))
    return JobLogin(name, password)


def delete_job_login(store: Store, keys: JobKeys) -> None:
    """Delete the job's user and role (its keys are deleted separately, with the prefix)."""
    name = job_user_name(keys)
    _tolerate(store, "UserDelete", rpc.AuthUserDeleteRequest(name=name), "user name not found")
    _tolerate(store, "RoleDelete", rpc.AuthRoleDeleteRequest(role=name), "role name not found")
