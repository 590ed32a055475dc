"""The state copy's plan as tables: tensor sizes, buckets (whole buckets straight from a large tensor, small
tensors and tails packed, empty tensors in none), which source sends each bucket, and that any plan's
buckets reassemble every tensor exactly; the receiver's tensors for a layout (optimizer slots it lacks are
made, not attached); bad arguments named."""

from __future__ import annotations

import pytest

from stalwart.restart.copy_plan import Bucket, Piece, assign_sources, plan_buckets, tensor_bytes
from stalwart.restart.peers import _check_arguments


@pytest.mark.parametrize(("shape", "dtype", "expected"), [
    ((3,), "float16", 6),
    ((2, 3), "float64", 48),
    ((), "float32", 4),
    ((0, 5), "int64", 0),
    ((7,), "bool", 7),
    ((2, 2), "bfloat16", 8),
    ((3,), "complex128", 48),
])
def test_tensor_bytes(shape: tuple[int, ...], dtype: str, expected: int) -> None:
    assert tensor_bytes(shape, dtype) == expected


@pytest.mark.parametrize(("shape", "dtype", "message"), [
    ((3,), "qint8", "dtype: expected one of"),
    ((-1,), "float32", "shape: expected sizes >= 0"),
])
def test_tensor_bytes_bad_input(shape: tuple[int, ...], dtype: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tensor_bytes(shape, dtype)


def P(tensor: int, offset: int, length: int) -> Piece:
    return Piece(tensor, offset, length)


@pytest.mark.parametrize(("sizes", "bucket", "expected"), [
    ([], 32, ()),
    ([10, 20, 5], 32, (Bucket((P(0, 0, 10), P(1, 0, 20))), Bucket((P(2, 0, 5),)))),
    ([0, 8, 0], 8, (Bucket((P(1, 0, 8),)),)),  # empty tensors travel in no bucket
    ([70], 32, (Bucket((P(0, 0, 32),)), Bucket((P(0, 32, 32),)), Bucket((P(0, 64, 6),)))),
    ([70, 3], 32, (Bucket((P(0, 0, 32),)), Bucket((P(0, 32, 32),)), Bucket((P(0, 64, 6), P(1, 0, 3))))),
    # A small tensor's bucket closes before a large one's own buckets; the large one's tail is packed on.
    ([5, 40, 5], 32, (Bucket((P(0, 0, 5),)), Bucket((P(1, 0, 32),)), Bucket((P(1, 32, 8), P(2, 0, 5))))),
    ([4, 4, 4], 12, (Bucket((P(0, 0, 4), P(1, 0, 4), P(2, 0, 4))),)),
    ([4, 4, 4], 11, (Bucket((P(0, 0, 4), P(1, 0, 4))), Bucket((P(2, 0, 4),)))),
    ([1, 1], 1, (Bucket((P(0, 0, 1),)), Bucket((P(1, 0, 1),)))),
])
def test_plan_buckets(sizes: list[int], bucket: int, expected: tuple[Bucket, ...]) -> None:
    assert plan_buckets(sizes, bucket) == expected


@pytest.mark.parametrize(("sizes", "bucket", "message"), [
    ([4], 0, "bucket_bytes: expected >= 1"),
    ([4, -2], 8, r"sizes\[1\]: expected >= 0 bytes"),
])
def test_plan_buckets_bad_input(sizes: list[int], bucket: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_buckets(sizes, bucket)


# Layouts of mixed dtypes, odd sizes, scalars and empty tensors; each bucket size cuts them differently.
LAYOUTS = [
    [((5, 3), "float32"), ((3,), "float32"), ((7, 3), "float64"), ((), "float32"), ((0, 4), "float32"),
     ((5,), "int64"), ((3,), "bool"), ((3,), "float16"), ((2, 2), "bfloat16")],
    [((1000,), "float32"), ((1,), "uint8"), ((333,), "float16"), ((0,), "int64"), ((17, 19), "float64")],
    [((0,), "float32")],
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bucket", [1, 3, 16, 64, 1000, 4001, 1 << 20])
@pytest.mark.parametrize("sources", [(0,), (0, 1), (2, 0, 1)])
def test_buckets_reassemble_exactly(layout: list[tuple[tuple[int, ...], str]], bucket: int,
                                    sources: tuple[int, ...]) -> None:
    sizes = [tensor_bytes(shape, dtype) for shape, dtype in layout]
    buckets = plan_buckets(sizes, bucket)
    senders = assign_sources([b.nbytes for b in buckets], sources)
    # The sources' tensors: distinct bytes; the receiver's start as zeros. Each bucket is packed by its sender
    # (staged as the wire would) and unpacked by the receiver.
    held = [bytes((7 * i + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    got = [bytearray(n) for n in sizes]
    covered = [0] * len(sizes)
    for b, sender in zip(buckets, senders, strict=True):
        assert 0 < b.nbytes <= bucket and sender in sources
        message = b"".join(held[p.tensor][p.offset:p.offset + p.length] for p in b.pieces)
        at = 0
        for p in b.pieces:
            assert p.length > 0 and p.offset + p.length <= sizes[p.tensor]
            got[p.tensor][p.offset:p.offset + p.length] = message[at:at + p.length]
            covered[p.tensor] += p.length
            at += p.length
    assert [bytes(g) for g in got] == held
    assert covered == sizes  # with the ranges inside each tensor, every byte exactly once


@pytest.mark.parametrize(("sizes", "sources", "expected"), [
    ([32, 32, 32, 32], (0, 1), (0, 1, 0, 1)),
    ([32, 8, 8, 8, 8], (0, 1), (0, 1, 1, 1, 1)),
    ([10], (3,), (3,)),
    ([5, 5, 5], (2, 0), (2, 0, 2)),  # ties go to the first listed
    ([], (0, 1), ()),
    ([6, 6, 6, 6, 6, 6], (4, 5, 6), (4, 5, 6, 4, 5, 6)),
])
def test_assign_sources(sizes: list[int], sources: tuple[int, ...], expected: tuple[int, ...]) -> None:
    assert assign_sources(sizes, sources) == expected


@pytest.mark.parametrize(("sources", "message"), [((), "at least one rank"), ((1, 1), "distinct ranks")])
def test_assign_sources_bad_input(sources: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        assign_sources([4], sources)


def test_the_receiver_makes_the_optimizer_slots_it_lacks() -> None:
    import torch
    from torch import nn

    from stalwart.restart.peers import _entries, _receiving

    torch.manual_seed(0)
    trained, fresh = nn.Linear(3, 2), nn.Linear(3, 2)
    opt = torch.optim.Adam(trained.parameters())
    trained(torch.ones(1, 3)).sum().backward()
    opt.step()
    layout = [s for s, _ in _entries(trained, opt)]
    fresh_opt = torch.optim.Adam(fresh.parameters())
    found = _receiving(fresh, fresh_opt, layout)
    assert [s.name for s in layout if s.name.startswith("optimizer.")] == [
        "optimizer.0.exp_avg", "optimizer.0.exp_avg_sq", "optimizer.0.step",
        "optimizer.1.exp_avg", "optimizer.1.exp_avg_sq", "optimizer.1.step"]
    # Model tensors are the receiver's own; every optimizer slot is new, shaped as the source's, not attached.
    assert [new for _, new in found] == [False, False] + [True] * 6
    assert [tuple(t.shape) for t, _ in found] == [s.shape for s in layout]
    assert found[0][0] is fresh.weight
    assert len(fresh_opt.state) == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"step": -1}, "step: expected an int >= 0 or None"),
    ({"transport": "tcp"}, "transport: expected one of group, streams, got 'tcp'"),
    ({"bucket_bytes": 0}, "bucket_bytes: expected an int >= 1"),
    ({"max_sources": 0}, "max_sources: expected an int >= 1 or None"),
    ({"streams": 0}, "streams: expected an int >= 1"),
    ({"timeout_s": 0.0}, "timeout_s: expected seconds > 0"),
])
def test_bad_arguments_are_named(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"step": None, "transport": "group", "bucket_bytes": 64, "max_sources": None,
                               "streams": 2, "timeout_s": 1.0}
    with pytest.raises(ValueError, match=message):
        _check_arguments(**{**args, **kwargs})  # type: ignore[arg-type]
