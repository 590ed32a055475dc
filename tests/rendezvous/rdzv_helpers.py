"""Helpers of the rendezvous tests: run nodes from threads and collect what each got."""

from __future__ import annotations

import threading

from stalwart.agent.rendezvous import NodeHandle, RoundInfo
from stalwart.api.rendezvous import NodeRecord

JOIN_TIMEOUT = 60.0


def record(node_id: str, **kw: object) -> NodeRecord:
    return NodeRecord(node_id=node_id, address="127.0.0.1", **kw)  # type: ignore[arg-type]


def join_all(handles: list[NodeHandle], timeout: float = JOIN_TIMEOUT) -> dict[str, RoundInfo | BaseException]:
    """Join every handle from its own thread; returns each node's RoundInfo or the error it raised."""
    results: dict[str, RoundInfo | BaseException] = {}

    def go(h: NodeHandle) -> None:
        try:
            results[h.node_id] = h.join(timeout=timeout)
        except BaseException as e:
            results[h.node_id] = e

    threads = [threading.Thread(target=go, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return results


def infos(results: dict[str, RoundInfo | BaseException]) -> dict[str, RoundInfo]:
    errors = {k: v for k, v in results.items() if isinstance(v, BaseException)}
    assert not errors, errors
    return {k: v for k, v in results.items() if isinstance(v, RoundInfo)}
