"""Shared-memory arenas: the ring's bookkeeping, refusals, and real agents moving large tensors through them."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rpc_helpers import TOKEN, shutdown_all, wait_for, world

from stalwart.rpc import shm
from stalwart.rpc.codec import Blobs
from stalwart.rpc.shm import (
    HEADER_BYTES,
    MIN_ARENA_BYTES,
    ArenaError,
    ArenaReader,
    ArenaWriter,
    Budget,
    Descriptor,
    Offer,
    Ring,
)
from stalwart.rpc.streams import StreamTransport

#: The names of the arenas this process made during the current test (see ``_record_arenas``).
_made: set[str] = set()


@pytest.fixture(autouse=True)
def _record_arenas(monkeypatch: pytest.MonkeyPatch) -> None:
    made = shm.ArenaWriter.__init__
    _made.clear()

    def recording(self: shm.ArenaWriter, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        _made.add(self.name)

    monkeypatch.setattr(shm.ArenaWriter, "__init__", recording)


def _arena_files() -> set[str]:
    """The arenas this test made that are still in /dev/shm. The directory is the machine's: other suites and
    the other xdist workers' tests make arenas there too, which come and go, so a test asks only about its
    own (and, as before, that none is left: ``now - before``)."""
    return {f for f in os.listdir(shm.SHM_DIR) if f.startswith("stalwart-rpc-")} & _made


# -- the ring (pure) ------------------------------------------------------------------------------------------

def test_ring_allocates_in_order_skips_the_tail_end_and_waits_for_releases() -> None:
    ring = Ring(100)
    assert ring.alloc(40) == (0, 40)
    assert ring.alloc(40) == (40, 80)
    assert ring.alloc(30) is None  # 20 left at the end, nothing released yet
    ring.release(40)
    assert ring.alloc(30) == (0, 130)  # the last 20 bytes are skipped: a frame never wraps
    assert ring.used == 90
    assert ring.alloc(11) is None
    assert ring.alloc(101) is None and ring.alloc(0) is None
    ring.release(130)
    assert ring.used == 0
    assert ring.alloc(70) == (30, 200)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(1, 64), st.booleans()), max_size=60))
def test_ring_never_hands_out_a_byte_that_is_still_unread(ops: list[tuple[int, bool]]) -> None:
    capacity = 100
    ring = Ring(capacity)
    live: list[tuple[int, int, int]] = []  # (start, length, end position) not yet released, in order
    for n, release_first in ops:
        if release_first and live:
            ring.release(live.pop(0)[2])
        got = ring.alloc(n)
        if got is None:
            continue
        start, end = got
        assert start >= 0 and start + n <= capacity
        for s, length, _ in live:
            assert start + n <= s or s + length <= start, "overlaps a region the receiver has not read"
        live.append((start, n, end))
        assert ring.used <= capacity


# -- offers, descriptors, arenas ------------------------------------------------------------------------------

@pytest.mark.parametrize(("data", "match"), [
    (b"short", "offer of"),
    (Offer("stalwart-rpc-" + "0" * 32, MIN_ARENA_BYTES, b"c" * 16).encode()[:-1] + b"/", "not of the form"),
    (Offer("stalwart-rpc-" + "0" * 32, 10, b"c" * 16).encode(), "size"),
])
def test_bad_offers_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(ArenaError, match=match):
        Offer.decode(data)


def test_an_offer_naming_another_file_is_refused_before_anything_is_opened() -> None:
    bad = Offer("stalwart-rpc-" + "0" * 32, MIN_ARENA_BYTES, b"c" * 16).encode().replace(
        b"stalwart-rpc-" + b"0" * 32, b"../../etc/passwd" + b"0" * 29)
    with pytest.raises(ArenaError, match="not of the form"):
        Offer.decode(bad)


def test_writer_and_reader_share_frames_and_leave_no_file() -> None:
    before = _arena_files()
    writer = ArenaWriter(MIN_ARENA_BYTES)
    try:
        reader = ArenaReader(Offer.decode(writer.offer.encode()))
        writer.unlink()  # as after the peer's accept: the mappings stay
        assert not _arena_files() - before
        payload = torch.arange(1000, dtype=torch.float32)
        blobs = Blobs()
        blobs.add_tensor(payload, "t")  # a view of the tensor's own memory, as the codec sends it
        parts: list[Any] = [b"head", memoryview(bytearray(b"-mid-")), *blobs.buffers]
        d = writer.put(parts, 4 + 5 + 4000)
        assert d is not None and d.offset >= HEADER_BYTES
        got = reader.take(Descriptor.decode(d.encode()))
        assert bytes(got[:9]) == b"head-mid-" and len(got) == 4009
        assert torch.equal(torch.frombuffer(got[9:], dtype=torch.float32), payload)
        with pytest.raises(ArenaError, match="outside"):
            reader.take(Descriptor(d.end, MIN_ARENA_BYTES - 10, 100))
        with pytest.raises(ArenaError, match="outside"):
            reader.take(Descriptor(d.end, 0, 10))  # the cookie is not a frame
        reader.close()
    finally:
        writer.close()
    assert not _arena_files() - before


def test_an_arena_with_another_cookie_or_none_at_all_is_refused() -> None:
    writer = ArenaWriter(MIN_ARENA_BYTES)
    try:
        with pytest.raises(ArenaError, match="cookie"):
            ArenaReader(Offer(writer.name, writer.size, b"x" * 16))
        with pytest.raises(ArenaError, match="the offer says"):
            ArenaReader(Offer(writer.name, writer.size * 2, writer.cookie))
    finally:
        writer.close()
    with pytest.raises(ArenaError, match="not the same host"):
        ArenaReader(Offer(writer.name, writer.size, writer.cookie))


def test_transport_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="arena_bytes"):
        StreamTransport(TOKEN, arena_bytes=1000)
    with pytest.raises(ValueError, match="max_frame_bytes"):
        StreamTransport(TOKEN, max_frame_bytes=1 << 31)


# -- real agents ----------------------------------------------------------------------------------------------

def _pair(**transport_options: Any) -> tuple[list[Any], list[StreamTransport]]:
    transports: list[StreamTransport] = []

    def keep(i: int, inner: StreamTransport) -> StreamTransport:
        t = StreamTransport(TOKEN, **transport_options)
        transports.append(t)
        return t

    agents, _ = world(2, wrap=keep)
    return agents, transports


def test_large_tensors_go_through_the_arena_both_ways_and_wrap_around_it() -> None:
    before = _arena_files()
    agents, transports = _pair(arena_bytes=MIN_ARENA_BYTES * 4)
    a, _b = agents
    try:
        for i in range(40):  # 40 x 512 KiB each way: the 4 MiB rings wrap several times
            t = torch.full((128 * 1024,), float(i))
            back = a.rpc_sync("w1", "t.echo", (t,))
            assert torch.equal(back, t)
        ours, theirs = transports
        assert len(_made) >= 2, "the record sees both directions' arenas, so the checks below can fail"
        assert ours.stats["arena_frames_out"] >= 30 and theirs.stats["arena_frames_in"] >= 30
        assert theirs.stats["arena_frames_out"] >= 30 and ours.stats["arena_frames_in"] >= 30
        # many at once: what does not fit in the ring goes inline, and every result is still right
        futures = [a.rpc_async("w1", "t.echo", (torch.full((256 * 1024,), float(i)),)) for i in range(40)]
        for i, f in enumerate(futures):
            assert torch.equal(f.wait(60), torch.full((256 * 1024,), float(i)))
        assert not _arena_files() - before  # unlinked as soon as both sides had them mapped
    finally:
        shutdown_all(agents)
    assert not _arena_files() - before


def test_budget_caps_what_a_process_holds() -> None:
    budget = Budget(3 * MIN_ARENA_BYTES)
    assert budget.take(2 * MIN_ARENA_BYTES) and not budget.take(2 * MIN_ARENA_BYTES)
    budget.give(2 * MIN_ARENA_BYTES)
    assert budget.take(3 * MIN_ARENA_BYTES) and budget.used == 3 * MIN_ARENA_BYTES
    with pytest.raises(ValueError, match="arena_budget"):
        StreamTransport(TOKEN, arena_budget=-1)


@pytest.mark.parametrize("options", [{"arena_bytes": 0}, {"arena_budget": 0}], ids=["no-arena", "budget-spent"])
def test_without_an_arena_frames_go_inline(options: dict[str, int]) -> None:
    agents, transports = _pair(**options)
    try:
        t = torch.randn(300_000)
        assert torch.equal(agents[0].rpc_sync("w1", "t.echo", (t,)), t)
        assert sum(tr.stats["arena_frames_out"] for tr in transports) == 0
    finally:
        shutdown_all(agents)


def test_when_the_peer_cannot_map_the_arena_frames_go_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    def elsewhere(self: ArenaReader, offer: Offer) -> None:
        raise ArenaError("no arena here: not the same host")

    monkeypatch.setattr(ArenaReader, "__init__", elsewhere)  # as a peer on another host finds it
    before = _arena_files()
    agents, transports = _pair()
    try:
        t = torch.randn(300_000)
        assert torch.equal(agents[0].rpc_sync("w1", "t.echo", (t,)), t)
        assert sum(tr.stats["arena_frames_out"] for tr in transports) == 0
        wait_for(lambda: not _arena_files() - before, what="refused arenas removed")
    finally:
        shutdown_all(agents)
