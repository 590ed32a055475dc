"""Our own random generator, for retry jitter, port draws and generated names.

The global generator of :mod:`random` belongs to the user's script: a rank that seeds it for its data order
must get the same order whatever our background threads (lease keep-alives, the fault monitor, retries) draw
meanwhile. Like the global one, ours is seeded again in a forked child, so ranks forked from one server do not
jitter in step.
"""

from __future__ import annotations

import os
import random

__all__ = ["RNG"]

RNG = random.Random()
os.register_at_fork(after_in_child=RNG.seed)
