"""What a node learns of its rounds: its place in a sealed round, why a round ended, and the events listeners of
:meth:`~stalwart.agent.rendezvous.driver.Rendezvous.subscribe` get. Frozen records, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.agent.rendezvous.protocol import Role
from stalwart.api.manifest import ManifestHeader
from stalwart.api.rendezvous import Manifest, Member

__all__ = ["Closed", "RoundEnd", "RoundEnded", "RoundEvent", "RoundInfo", "RoundSealed"]


@dataclass(frozen=True, slots=True)
class RoundInfo:
    """A node's place in a sealed round.

    ``role`` is ``"member"`` (it runs ranks), ``"spare"`` (present beyond ``max_nodes``; waits for a later
    round) or ``"waiting"`` (it arrived after the round was sealed; it is in the next one).
    ``node_revision`` is the ``create_revision`` of the node's key, used to fence its writes. ``header`` is
    the round without its member list; ``manifest`` the whole round when this process holds it (a large
    round's manifest is read only by the sealer: every other node reads its own bucket).
    """

    node_id: str
    epoch: int
    role: Role
    header: ManifestHeader
    node_revision: int
    #: This node's member entry, ``None`` unless ``role == "member"``.
    member: Member | None = None
    #: This node's place among the spares, ``None`` unless ``role == "spare"``.
    spare_index: int | None = None
    manifest: Manifest | None = None

    @property
    def round(self) -> int:
        return self.header.round

    @property
    def world_size(self) -> int:
        return self.header.world_size


@dataclass(frozen=True, slots=True)
class RoundEnd:
    """Why the round of ``epoch`` is over for a node."""

    epoch: int
    reason: str
    #: Members whose keys went (lease expiry or leave), if that is why.
    lost: tuple[str, ...] = ()
    #: The rendezvous was closed (no further round will come).
    closed: bool = False
    #: This node's own key is gone (it must join again).
    self_lost: bool = False


@dataclass(frozen=True, slots=True)
class RoundSealed:
    """Listener event: a new round was sealed (``manifest``: the whole round, when this process holds it)."""

    epoch: int
    header: ManifestHeader
    manifest: Manifest | None


@dataclass(frozen=True, slots=True)
class RoundEnded:
    """Listener event: the round of ``epoch`` ended (a member was lost or a re-rendezvous was requested)."""

    epoch: int
    reason: str
    lost: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Closed:
    """Listener event: the rendezvous was closed."""


RoundEvent = RoundSealed | RoundEnded | Closed
