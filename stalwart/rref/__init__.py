"""Remote references (RRef) with distributed reference counting, fenced by round and fate-sharing with owners.

:mod:`.book` is the protocol's bookkeeping (pure); :mod:`.handle` the handles user code holds. The messages
travel through the RPC agent (:mod:`stalwart.rpc.agent`), which creates RRefs with ``remote``.
"""

from stalwart.rpc.errors import NotOwner, OwnerDied, RRefCreationFailed, RRefDeleted, RRefError
from stalwart.rref.book import RRefBook
from stalwart.rref.handle import OwnerRRef, RRef, UserRRef

__all__ = ["NotOwner", "OwnerDied", "OwnerRRef", "RRef", "RRefBook", "RRefCreationFailed", "RRefDeleted",
           "RRefError", "UserRRef"]
