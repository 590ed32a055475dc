"""The JSON records of ``stalwart drill``'s faults through the job's agents, kept in etcd under
``JobKeys.drill``.

``D + "requests/<id>"`` -> :class:`DrillRequest`
    Written by ``stalwart drill`` (bound to a lease, so it goes by itself): which node, which local rank,
    which fault. Signed with HMAC-SHA256 under a key derived from the job's token for drill signing only
    (:mod:`stalwart.api.keys`; the token is the ``rpc-token`` of the job's Secret, which the
    agents have as ``STALWART_RPC_TOKEN``): an agent carries out only a request whose signature it can check,
    for its own job, within its validity, once, and only when the job opted in
    (``spec.faultInjection.enabled``).
``D + "results/<id>"`` -> :class:`DrillResult`
    The agent's answer: carried out (and on which process) or refused (and why).

An accepted ``rank-exception`` reaches the rank through files next to its status file and a signal from its
own agent (same pod, same user), never from the network: the rank says it accepts drills in
:func:`marker_path` (``{"pid": ..., "signal": "SIGUSR2"}``), the agent writes the request's id to
:func:`request_path` and sends :data:`DRILL_SIGNAL`, the rank answers in :func:`ack_path`
(``{"id": ..., "raised": true|false}``).

JSON only; nothing here is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import signal
from typing import Literal

from pydantic import Field, field_validator

from stalwart.api.base import ApiModel
from stalwart.api.keys import purpose_key

__all__ = ["AGENT_KINDS", "DRILL_SIGNAL", "MAX_LIFETIME", "DrillKind", "DrillRequest", "DrillResult", "ack_path",
           "marker_path", "request_path"]

DrillKind = Literal["rank-exception", "rank-kill", "rank-hang"]
#: The faults an agent carries out (the others go through the Kubernetes API).
AGENT_KINDS: tuple[DrillKind, ...] = ("rank-exception", "rank-kill", "rank-hang")
#: Longest validity of a request (``expires - issued``), in seconds.
MAX_LIFETIME = 300.0

#: The signal an agent sends a rank process to raise a drill's exception in its training function.
DRILL_SIGNAL = signal.SIGUSR2

_ID = re.compile(r"^[0-9a-f]{16,64}$")


class DrillRequest(ApiModel):
    """A fault for one rank process of one node, signed with the job's token."""

    id: str = Field(description="Random hex id of the request (16-64 characters); also its key.")
    job_uid: str = Field(min_length=1, description="metadata.uid of the TrainingJob.")
    node_id: str = Field(min_length=1, description="The pod whose agent carries it out.")
    local_rank: int = Field(default=0, ge=0, description="Local rank of the process on that pod.")
    kind: DrillKind = Field(description="rank-exception, rank-kill (SIGKILL) or rank-hang (the process freezes).")
    issued: float = Field(description="Wall-clock time the request was made (Unix seconds).")
    expires: float = Field(description="Wall-clock time after which it must not be carried out.")
    signature: str = Field(default="", description="Hex HMAC-SHA256 of the other fields under the drill-signing "
                                                   "key of the job's token.")

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not _ID.fullmatch(value):
            raise ValueError("expected 16-64 lower-case hex characters")
        return value

    def payload(self) -> bytes:
        """The signed bytes: every field but the signature, as canonical JSON."""
        data = self.model_dump(by_alias=True, exclude={"signature"})
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, token: bytes) -> DrillRequest:
        """Signed under the drill-signing key derived from the job's ``token`` (never the token itself, which
        also keys RPC and the torchrun state: :mod:`stalwart.api.keys`)."""
        key = purpose_key(token, "drill-signing")
        return self.model_copy(update={"signature": hmac.new(key, self.payload(), hashlib.sha256).hexdigest()})

    def verify(self, token: bytes) -> bool:
        """Whether the signature is this request's under the drill-signing key of ``token`` (compared in
        constant time)."""
        expected = hmac.new(purpose_key(token, "drill-signing"), self.payload(), hashlib.sha256).hexdigest()
        return hmac.compare_digest(expected, self.signature)


class DrillResult(ApiModel):
    """An agent's answer to a :class:`DrillRequest`."""

    id: str = Field(description="The request's id.")
    node_id: str = Field(description="The answering node.")
    accepted: bool = Field(description="The fault was carried out.")
    reason: str = Field(default="", max_length=1024, description="What was done, or why it was refused.")
    local_rank: int | None = Field(default=None, description="The local rank it was done to.")
    rank: int | None = Field(default=None, description="That process's global rank at the time, when known.")
    slot: int | None = Field(default=None, description="That process's slot.")
    pid: int | None = Field(default=None, description="That process's pid.")
    time: float = Field(description="Wall-clock time the fault was carried out (or refused).")


def marker_path(status_file: str) -> str:
    """Written by a rank that accepts drills: ``{"pid": ..., "signal": "SIGUSR2"}``."""
    return status_file + ".drill"


def request_path(status_file: str) -> str:
    """Written by the agent before it signals: ``{"id": ...}``."""
    return status_file + ".drill-request"


def ack_path(status_file: str) -> str:
    """Written by the rank when the signal arrives: ``{"id": ..., "raised": true|false}``."""
    return status_file + ".drill-ack"
