"""The status file tells the agent (and through it the operator) the limit the rank judges itself by now: the
startup allowance until its first ping in an iteration, the soft timeout after. The operator judges a stall by
it; judged by the soft timeout alone, a survivor whose new group waited for a respawned peer was named as a
stalled rank while it was, by its own rule, still starting."""

from __future__ import annotations

from pathlib import Path

from restart_helpers import new_job

from stalwart.api.restart import RankStatus
from stalwart.etcd.store import Store
from stalwart.etcd.torch_store import EtcdTorchStore
from stalwart.restart.coordination import Coordinator
from stalwart.restart.interrupt import Interrupter
from stalwart.restart.monitor import Monitor, StatusFile
from stalwart.restart.policies import IterationContext


def test_the_status_says_the_startup_allowance_until_the_first_ping(store: Store, tmp_path: Path) -> None:
    keys, epoch = new_job(store)
    coord = Coordinator(store, keys, epoch, slot=0, node_id="node-0", lease_ttl=5, retry_for=10.0)
    path = tmp_path / "rank-0.json"
    interrupter = Interrupter()
    monitor = Monitor(coord, interrupter, soft_timeout=5.0, startup_timeout=120.0, interval=60.0,
                      status=StatusFile(str(path)), watch_main_thread=False, end_process=lambda code: None)

    def written() -> RankStatus:
        monitor.update_status(state="running")  # a state change writes the file at once
        return RankStatus.model_validate_json(path.read_bytes())

    try:
        for iteration in (0, 1):
            interrupter.enter_user_code()
            ctx = IterationContext(iteration=iteration, slot=0, rank=0, world_size=2,
                                   store=EtcdTorchStore(store, keys, epoch, scope=f"{iteration}/", timeout=10.0))
            monitor.begin(iteration, ctx)
            assert written().stall_limit == 120.0  # a new iteration starts without a ping
            monitor.ping(step=iteration * 10 + 1)
            assert written().stall_limit == 5.0
            interrupter.leave_user_code()
            monitor.end()
    finally:
        monitor.stop()
        coord.stop()
