"""Dropping a failed iteration's frames must end even when exception contexts form a cycle."""

from __future__ import annotations

import gc
import weakref

from stalwart.restart.errors import release_frames


class Held:
    pass


def _fail(held: Held) -> None:
    raise RuntimeError("in the iteration")


def test_release_clears_frames_and_survives_a_context_cycle() -> None:
    held = Held()
    ref = weakref.ref(held)
    try:
        _fail(held)
    except RuntimeError as e:
        first = e
    del held
    second = ValueError("interrupt")
    # A cycle: what an interrupt delivered while the first exception was being handled can leave behind.
    second.__context__ = first
    first.__context__ = second
    release_frames(second)  # must return
    assert first.__traceback__ is None and second.__traceback__ is None
    gc.collect()
    assert ref() is None, "the failed frame's locals are still alive"
