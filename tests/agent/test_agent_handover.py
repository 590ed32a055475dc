"""The agent's decisions at a round's end (keep the processes or not, what to do in the next round), what a
handover carries, and the rank's side of the file: table tests, and a watch over a real file."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from stalwart.agent.handover import grow_due, handover_env, keep_at_round_end, next_step, write_handover
from stalwart.agent.supervision import ProcView
from stalwart.api.handover import Handover
from stalwart.restart.handover import RoundOver, RoundWatch, newer, read_handover
from stalwart.restart.inotify import file_wait

RUNNING = ProcView(0, None, wrapped=True)


@pytest.mark.parametrize(("procs", "parked", "warm", "keep"), [
    ([RUNNING, ProcView(1, None, wrapped=True)], False, True, True),
    ([RUNNING], False, False, False),                                # warm spares off: today's restart
    ([], False, True, False),                                        # nothing to keep
    ([RUNNING, ProcView(1, 0, wrapped=True)], False, True, False),   # one has exited
    ([RUNNING, ProcView(1, None, wrapped=True, stopped=True)], False, True, False),
    ([ProcView(0, None, wrapped=False)], False, True, False),        # a plain script cannot be handed over
    ([ProcView(0, None, wrapped=False)], True, True, True),          # a parked process waits for its round
])
def test_keep_at_round_end(procs: list[ProcView], parked: bool, warm: bool, keep: bool) -> None:
    assert keep_at_round_end(procs, parked=parked, warm=warm) is keep


@pytest.mark.parametrize(("role", "kept", "warm", "spare_ranks", "step"), [
    ("member", True, True, False, "hand_over"),
    ("member", False, True, False, "launch"),
    ("member", False, False, False, "launch"),
    ("spare", False, True, False, "park"),
    ("waiting", False, True, False, "park"),
    ("spare", False, False, False, "wait"),
    ("spare", False, False, True, "launch"),     # the in-round spare ranks of --spare-ranks
    ("waiting", True, False, False, "wait"),
])
def test_next_step(role: str, kept: bool, warm: bool, spare_ranks: bool, step: str) -> None:
    assert next_step(role, kept=kept, warm=warm, spare_ranks=spare_ranks) == step  # type: ignore[arg-type]


@pytest.mark.parametrize(("warm", "group_rank", "members", "waiting", "due"), [
    (True, 0, 1, 1, True),
    (True, 1, 1, 1, False),      # one asker: group rank 0
    (True, None, 1, 1, False),   # a spare does not ask
    (True, 0, 2, 1, False),      # already at max_nodes
    (True, 0, 1, 0, False),      # nobody to grow with
    (False, 0, 1, 1, False),     # warm spares off
])
def test_grow_due(warm: bool, group_rank: int | None, members: int, waiting: int, due: bool) -> None:
    assert grow_due(warm=warm, group_rank=group_rank, members=members, max_nodes=2, waiting=waiting) is due


def test_handover_env_carries_the_round_and_no_secret() -> None:
    env = {"RANK": "1", "MASTER_PORT": "29500", "STALWART_EPOCH": "9", "STALWART_SLOT": "1",
           "STALWART_RPC_TOKEN": "s3cret", "PATH": "/bin", "STALWART_HANDOVER_FILE": "/x", "HOME": "/root"}
    assert handover_env(env) == {"RANK": "1", "MASTER_PORT": "29500", "STALWART_EPOCH": "9", "STALWART_SLOT": "1"}


@pytest.mark.parametrize(("epoch", "current", "newer_"), [(5, 4, True), (4, 4, False), (3, 4, False)])
def test_newer(epoch: int, current: int, newer_: bool) -> None:
    h = Handover(epoch=epoch, round=2, env={"STALWART_EPOCH": str(epoch)})
    assert (newer(h, current) is h) is newer_
    assert newer(None, current) is None


def test_handover_record_names_a_bad_variable() -> None:
    with pytest.raises(ValueError, match="'A-B' is not a variable name"):
        Handover(epoch=2, round=2, env={"A-B": "1", "STALWART_EPOCH": "2"})
    with pytest.raises(ValueError, match="STALWART_EPOCH is required"):
        Handover(epoch=2, round=2, env={"RANK": "1"})


def test_watch_sees_a_newer_round_once_and_ignores_garbage(tmp_path: Path) -> None:
    path = tmp_path / "handover-0.json"
    seen: list[int] = []
    watch = RoundWatch(str(path), epoch=4, on_new=lambda h: seen.append(h.epoch))
    assert watch.poll() is None and read_handover(str(path)) is None  # no file yet
    path.write_text("{not json")
    assert watch.poll() is None
    write_handover(path, Handover(epoch=4, round=1, env={"STALWART_EPOCH": "4"}))  # its own round: not new
    assert watch.poll() is None
    write_handover(path, Handover(epoch=7, round=3, env={"STALWART_EPOCH": "7"}))
    found = watch.wait(deadline=None)
    assert found is not None and found.epoch == 7 and seen == [7]
    with pytest.raises(RoundOver, match="round 3 \\(epoch 7\\)"):
        watch.check()
    watch.switched(7)
    watch.check()  # in the new round now: nothing pending
    assert not list(tmp_path.glob(".handover-*")), "a temporary file was left behind"


def test_parked_wait_ends_when_the_agent_is_gone(tmp_path: Path) -> None:
    watch = RoundWatch(str(tmp_path / "h.json"), epoch=0)
    alive = threading.Event()
    assert watch.wait(deadline=None, alive=alive.is_set) is None


def test_a_file_wait_ends_on_its_file_only(tmp_path: Path) -> None:
    path = tmp_path / "handover.json"
    notify = file_wait(str(path))
    assert notify is not None, "inotify is available on Linux"
    try:
        (tmp_path / "rank-0.json").write_text("{}")  # another file of the directory: not a reason to wake
        assert notify.wait(0.2) is False
        write_handover(path, Handover(epoch=3, round=2, env={"STALWART_EPOCH": "3"}))  # by rename, as the agent
        assert notify.wait(30) is True
        assert notify.wait(0.1) is False  # nothing new since
    finally:
        notify.close()


def test_a_parked_wait_sleeps_until_its_handover(tmp_path: Path) -> None:
    path = tmp_path / "handover.json"
    watch = RoundWatch(str(path), epoch=0)
    writer = threading.Timer(0.3, write_handover, (path, Handover(epoch=5, round=2, env={"STALWART_EPOCH": "5"})))
    writer.start()
    try:
        found = watch.wait(deadline=None, block=60.0)  # without the file's event it would sleep for a minute
    finally:
        writer.join()
    assert found is not None and found.epoch == 5
