"""The JSON records of the rendezvous, as kept in etcd under ``JobKeys.rendezvous`` (``.../rdzv/``).

Key layout (``R`` = ``JobKeys(ns, uid).rendezvous``):

``R + "nodes/<nodeId>"`` -> :class:`NodeRecord`
    One key per node, bound to that node's lease (its heartbeat) and created only if absent
    (``create_revision == 0``). Its ``create_revision`` orders the nodes (survivors first, then by age).
``R + "sealer"`` -> :class:`SealerRecord`
    The node that plans and writes the manifests, bound to that node's lease and created only if absent: the
    first node to claim it holds it until its lease goes. Only the sealer's process watches every node key;
    every other process watches the control keys and only the deletions of node keys.
``R + "manifest"`` -> :class:`Manifest`, or a :class:`~stalwart.api.manifest.ManifestHeader` when the manifest
    is larger than 32 KiB (about 300 members). The sealed round, written by one writer in one transaction. Its
    ``mod_revision`` is the round's **epoch**: the fencing token every round-bound write compares.
``R + "manifest-parts/<index>"`` -> :class:`~stalwart.api.manifest.ManifestBucket`
    A large manifest's members and spares, in buckets by a hash of their node ids, written in the seal's
    transaction; the header holds each bucket's digest, so a reader takes only buckets of its own round. A
    node reads only its own bucket (:mod:`stalwart.api.manifest`). Buckets of an older manifest may remain.
``R + "request"`` -> :class:`RerendezvousRequest`
    A participant's request to end the round of ``epoch`` (written fenced by that epoch).
``R + "closed"`` -> :class:`ClosedRecord`
    Present once the rendezvous is closed: no new rounds are sealed.
``JobKeys.fenced(<podUid>)`` (``<job prefix>fenced/<podUid>``, beside ``R``) -> :class:`FenceRecord`
    Written by the operator when it fences a pod; its agent's registration compares it absent, so a zombie of
    a fenced pod back from a partition can never register (and so never join a round) again.
``R + "expected"`` -> :class:`ExpectedNodes`
    Optional, written by the operator: the node ids it expects, so a round seals as soon as they are all
    present instead of waiting for the last call.

Every value is a JSON document of one of these models, size-capped by :data:`MAX_RECORD_BYTES`. The manifest of
a 1024-node round is about 100 KiB; past about 300 nodes it is written in buckets
(:func:`~stalwart.api.manifest.encode_manifest`).
"""

from __future__ import annotations

import re
from typing import Self

from pydantic import Field, field_validator, model_validator

from stalwart.api.base import MAX_RECORD_BYTES, ApiModel

__all__ = [
    "MAX_LOST",
    "MAX_RECORD_BYTES",
    "ClosedRecord",
    "ExpectedNodes",
    "Manifest",
    "Member",
    "NodeRecord",
    "RerendezvousRequest",
    "SealerRecord",
    "TorchRendezvousState",
    "check_node_id",
]

#: The most lost members a manifest lists (the round's reason counts the rest).
MAX_LOST = 64

_NODE_ID = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def check_node_id(node_id: str) -> str:
    """Return ``node_id`` if it can be one etcd key segment (letters, digits, ``-_.``, at most 253 chars)."""
    if len(node_id) > 253 or not _NODE_ID.fullmatch(node_id):
        raise ValueError(
            f"node id {node_id!r} must be 1-253 letters, digits, '-', '_' or '.', starting and ending "
            "with a letter or digit")
    return node_id


class NodeRecord(ApiModel):
    """What a node says about itself when it joins (the value of its lease-bound node key)."""

    node_id: str = Field(description="Unique id of the node (the pod name).")
    address: str = Field(min_length=1, max_length=253,
                         description="Host or IP other nodes reach this node on (the pod IP).")
    nproc: int = Field(default=1, ge=1, le=1024, description="Rank processes this node runs.")
    spare: bool = Field(default=False,
                        description="A spare: becomes a member only when no ordinary node is left.")
    master_port: int | None = Field(default=None, ge=1, le=65535,
                                    description="Port this node offers as MASTER_PORT if it gets group rank 0.")
    rpc_port: int | None = Field(default=None, ge=1, le=65535,
                                 description="Port of this node's RPC server, if it runs one.")

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str) -> str:
        return check_node_id(v)


class Member(ApiModel):
    """One node of a sealed round and the ranks it runs."""

    node_id: str = Field(description="The node's id.")
    address: str = Field(description="The node's address (from its NodeRecord).")
    group_rank: int = Field(ge=0, description="The node's rank among the round's nodes (0..nodes-1).")
    rank_offset: int = Field(ge=0, description="Global rank of the node's first process.")
    nproc: int = Field(ge=1, description="Rank processes on the node: global ranks rankOffset..+nproc-1.")
    rpc_port: int | None = Field(default=None, description="The node's RPC port, if it runs an RPC server.")


class Manifest(ApiModel):
    """A sealed round. The key's ``mod_revision`` (not stored here) is the round's epoch."""

    round: int = Field(ge=1, description="Round number, 1 for the first round, +1 for each next one.")
    members: list[Member] = Field(min_length=1, description="The round's nodes, ordered by group rank.")
    spares: list[str] = Field(default_factory=list,
                              description="Ids of present nodes beyond the round's maximum: they wait as spares.")
    world_size: int = Field(ge=1, description="Total rank processes: the sum of the members' nproc.")
    master_addr: str = Field(description="Address of group rank 0 (MASTER_ADDR).")
    master_port: int | None = Field(default=None, description="MASTER_PORT offered by group rank 0, if any.")
    sealed_by: str = Field(description="Id of the node that sealed the round.")
    view_revision: int = Field(
        default=0, ge=0,
        description=("The etcd revision of the view the round was planned over. Every member's key existed "
                     "then and no node key was created between it and the seal, so a member whose key is "
                     "deleted after it is lost."))
    reason: str = Field(default="", max_length=1024,
                        description="Why this round started (first round, member lost, requested, ...).")
    lost: list[str] = Field(default_factory=list, max_length=MAX_LOST,
                            description=("Members of the previous round whose registration went before this "
                                         "seal (a lease that ran out, an agent that left), the first "
                                         f"{MAX_LOST}: why this round started."))

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        ranks = [m.group_rank for m in self.members]
        if ranks != list(range(len(self.members))):
            raise ValueError(f"members: group ranks must be 0..{len(self.members) - 1} in order, got {ranks}")
        offset = 0
        for m in self.members:
            if m.rank_offset != offset:
                raise ValueError(f"members: {m.node_id} has rankOffset {m.rank_offset}, expected {offset}")
            offset += m.nproc
        if offset != self.world_size:
            raise ValueError(f"worldSize: {self.world_size} != sum of members' nproc ({offset})")
        ids = [m.node_id for m in self.members] + list(self.spares)
        if len(set(ids)) != len(ids):
            raise ValueError("members/spares: a node id appears more than once")
        return self

    def member(self, node_id: str) -> Member | None:
        """The member entry of ``node_id``, or ``None`` if it is not a member of this round."""
        for m in self.members:
            if m.node_id == node_id:
                return m
        return None


class SealerRecord(ApiModel):
    """Who holds the sealer's key (its value; the key is bound to that node's lease)."""

    node_id: str = Field(description="The node that plans and writes the manifests.")

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str) -> str:
        return check_node_id(v)


class RerendezvousRequest(ApiModel):
    """A participant asks to end the round of ``epoch`` (e.g. after a failure it cannot recover in process)."""

    epoch: int = Field(ge=1, description="The epoch of the round to end; a request for an older round is void.")
    node_id: str = Field(description="The node that asked.")
    reason: str = Field(default="", max_length=1024, description="Why, for logs and status.")
    lost: list[str] = Field(default_factory=list, max_length=1024,
                            description="Members whose keys went, when that is why (written by the sealer).")


class FenceRecord(ApiModel):
    """The operator fenced a pod (it counted it lost, or deleted it): its agent may never register again."""

    node_id: str = Field(description="The fenced node (pod name).")
    pod_uid: str = Field(min_length=1, max_length=64, description="The fenced pod's uid (its incarnation).")
    reason: str = Field(default="", max_length=1024, description="Why it was fenced.")

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str) -> str:
        return check_node_id(v)


class ClosedRecord(ApiModel):
    """The rendezvous is closed: no new rounds; nodes outside the current round leave."""

    reason: str = Field(default="", max_length=1024, description="Why it was closed.")


class ExpectedNodes(ApiModel):
    """The nodes the operator expects; a round seals as soon as all of them are present."""

    node_ids: list[str] = Field(min_length=1, description="Ids of the expected nodes.")

    @field_validator("node_ids")
    @classmethod
    def _ids(cls, v: list[str]) -> list[str]:
        for node_id in v:
            check_node_id(node_id)
        return v


class TorchRendezvousState(ApiModel):
    """The envelope in which the etcd-v3 backend keeps torch's DynamicRendezvousHandler state.

    torch's handler encodes its own state (it pickles it); the backend stores it as opaque base64 inside this
    JSON document, so a foreign or damaged value is recognised as corrupt before torch ever sees it.
    """

    format: str = Field(description="Always 'torch-dynamic-rendezvous/v1'.")
    state: str = Field(description="torch's encoded state, base64.")
    mac: str = Field(default="", max_length=64,
                     description=("HMAC-SHA256 (hex) of the key, the format and the state with the run's secret: "
                                  "torch unpickles the state, so one that fails the check is refused."))
