"""Authentication: who a request comes from, from its bearer token.

- The admin token (a static token, as ``--token-auth-file`` gives one) is the user ``kubernetes-admin`` in the
  group ``system:masters``; ``stalwart local up`` writes it into the cluster's kubeconfig.
- ServiceAccount tokens are issued by the TokenRequest API (``serviceaccounts/<name>/token``, what ``kubectl
  create token`` calls): JWTs with the claims the API server puts in them (issuer, audiences, expiry, the
  namespace and the ServiceAccount's name and uid, the pod a token is bound to), signed with a key only this
  API server holds (HMAC-SHA256). A token is valid while unexpired, for one of the API server's audiences, and
  while its ServiceAccount (and bound pod) exist with the uids it names: deleting the account revokes it.
- No token: the anonymous user (``system:anonymous`` in ``system:unauthenticated``), which RBAC allows only
  the public health and version endpoints. A token that is not valid: 401.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.local.apiserver.authorization import ANONYMOUS, AUTHENTICATED, SUPERUSERS, UserInfo
from stalwart.local.apiserver.errors import unauthorized

JSON = dict[str, Any]
ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN = UserInfo("kubernetes-admin", groups=(SUPERUSERS, AUTHENTICATED))
MIN_EXPIRATION, MAX_EXPIRATION, DEFAULT_EXPIRATION = 600, 2**32, 3600


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Issued:
    token: str
    expires: int  # unix seconds


#: Looks up a live object's uid: (plural, namespace, name) -> uid, or None if there is none.
UidOf = Callable[[str, str, str], str | None]


class Authenticator:
    """See the module docstring. ``uid_of`` reads the store (ServiceAccounts and pods)."""

    def __init__(self, uid_of: UidOf, admin_token: str | None = None, key: bytes | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.uid_of = uid_of
        self.admin_token = admin_token or secrets.token_urlsafe(32)
        self._key = key or secrets.token_bytes(32)
        self._clock = clock

    def issue(self, namespace: str, name: str, sa_uid: str, *, audiences: list[str] | None = None,
              expiration_seconds: int = DEFAULT_EXPIRATION, pod: tuple[str, str] | None = None) -> Issued:
        """A token for ServiceAccount ``namespace/name`` (uid ``sa_uid``), bound to ``pod`` (name, uid) if given."""
        now = int(self._clock())
        claims: JSON = {
            "aud": audiences or [ISSUER], "exp": now + expiration_seconds, "iat": now, "nbf": now, "iss": ISSUER,
            "jti": str(uuid.uuid4()), "sub": f"system:serviceaccount:{namespace}:{name}",
            "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": name, "uid": sa_uid}},
        }
        if pod is not None:
            claims["kubernetes.io"]["pod"] = {"name": pod[0], "uid": pod[1]}
        header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        signature = _b64(hmac.new(self._key, f"{header}.{body}".encode(), hashlib.sha256).digest())
        return Issued(f"{header}.{body}.{signature}", claims["exp"])

    def verify(self, token: str, audiences: list[str] | None = None) -> UserInfo | None:
        """The user a token stands for, or None if it is not a valid token of this server."""
        if hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return ADMIN
        parts = token.split(".")
        if len(parts) != 3:
            return None
        expected = _b64(hmac.new(self._key, f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(expected.encode(), parts[2].encode()):
            return None
        try:
            claims = json.loads(_unb64(parts[1]))
            k8s = claims["kubernetes.io"]
            namespace, sa = str(k8s["namespace"]), k8s["serviceaccount"]
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None
        if int(claims.get("exp", 0)) <= self._clock():
            return None
        if not set(claims.get("aud") or []) & set(audiences or [ISSUER]):
            return None
        if self.uid_of("serviceaccounts", namespace, str(sa.get("name"))) != sa.get("uid"):
            return None  # the account is gone, or was made anew: its tokens are revoked
        extra: list[tuple[str, tuple[str, ...]]] = [("authentication.kubernetes.io/credential-id",
                                                     (f"JTI={claims.get('jti')}",))]
        pod = k8s.get("pod")
        if pod:
            if self.uid_of("pods", namespace, str(pod.get("name"))) != pod.get("uid"):
                return None
            extra += [("authentication.kubernetes.io/pod-name", (str(pod["name"]),)),
                      ("authentication.kubernetes.io/pod-uid", (str(pod["uid"]),))]
        return UserInfo(f"system:serviceaccount:{namespace}:{sa['name']}", str(sa.get("uid", "")),
                        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
                        tuple(extra))

    def authenticate(self, authorization: str | None) -> UserInfo:
        """The user of a request with this Authorization header: anonymous without one, 401 if it is not valid."""
        if not authorization:
            return ANONYMOUS
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized()
        user = self.verify(token.strip())
        if user is None:
            raise unauthorized()
        return user
