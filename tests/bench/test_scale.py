"""The scale simulator at a small N: the protocols' invariants hold at the end of every scenario.

The simulator runs stalwart's real rendezvous driver and protocol (one driver per simulated pod) and the real
restart Coordinator (one per simulated rank) against the in-memory etcd model, with fixed costs so that
every run is the same.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.scalesim.anchor import CasRun
from bench.scalesim.rendezvous import PREFIX, RendezvousRun
from bench.scalesim.restart import RestartRun
from bench.scalesim.sim import Costs
from stalwart.agent.rendezvous import protocol
from stalwart.agent.rendezvous.driver import _to_event
from stalwart.api.base import MAX_RECORD_BYTES
from stalwart.api.manifest import MANIFEST_PARTS
from stalwart.etcd.keys import MANIFEST

COSTS = Costs(rtt=0.0005, write=0.0003, read=0.002, read_byte=1e-8, event=3e-5, event_byte=5e-9)
N = 40


def written(run: RendezvousRun) -> int:
    """Proposals that wrote something: a lease grant per node, and one revision per transaction that wrote."""
    return len(run.agents) + len({ev.kv.mod_revision for ev in run.sim.mem.log})


def test_first_round_and_a_lost_node() -> None:
    run = RendezvousRun(N, COSTS)
    first = run.first_round(limit=600)
    assert first["sealed"] and first["nodes_done"] == N and first["error"] is None
    (epoch1, m1), = run.manifests()  # exactly one manifest for round 1
    assert m1.round == 1
    assert sorted(m.group_rank for m in m1.members) == list(range(N))
    assert {m.node_id for m in m1.members} == {f"trainjob-worker-{i}" for i in range(N)}
    assert m1.spares == ["trainjob-spare-0"] and m1.world_size == 8 * N
    # Every node holds round 1 once, in its role; two writes per node (lease, key) and one seal.
    assert all(list(a.held) == [epoch1] for a in run.agents)
    assert Counter(a.roles[epoch1] for a in run.agents) == {"member": N, "spare": 1}
    assert written(run) == 2 * (N + 1) + 1
    # Besides, at most one seal refused by its fence: the sealer's view a registration behind (the spare's, as the
    # events reach it when committed), a proposal that writes nothing (etcd proposes a transaction that may write).
    assert first["writes"] - written(run) in (0, 1)
    assert first["writes"] / (N + 1) <= 3
    # Each simulated pod has its own watch; only the sealer's holds every node key (a full view), the others are
    # sent the control keys and deletions: no node's registration went to more than one watcher.
    [sealer] = [p for p in run.procs if p.rdzv.view().full]
    assert sealer.rdzv.view().sealer.node_id in sealer.rdzv._state.local  # type: ignore[union-attr]
    assert all(p.node_puts == 0 for p in run.procs if p is not sealer)
    assert first["watch_events"] <= 3 * (N + 1)
    # The sealer's view is what the real apply gives over the whole log.
    direct = protocol.apply(protocol.View(), [_to_event(PREFIX, ev) for ev in run.sim.mem.log])
    assert sealer.rdzv.view().nodes == direct.nodes and sealer.rdzv.view().epoch == direct.epoch

    victim = run.agents[N // 2]
    again = run.lose_one(limit=600)
    assert again["nodes_done"] == N and again["seconds"] is not None and again["writes"] == 2
    manifests = run.manifests()
    assert [m.round for _, m in manifests] == [1, 2]  # one manifest per round, in order
    epoch2, m2 = manifests[1]
    assert epoch2 > epoch1
    by_id = {m.node_id: m.group_rank for m in m2.members}
    assert victim.handle.node_id not in by_id
    # The spare takes the lost node's ranks: its group rank in round 1, whichever that was (the order the
    # registrations arrived in depends on the code's CPU time, which the simulator charges as measured).
    lost = m1.member(victim.handle.node_id)
    assert lost is not None and by_id["trainjob-spare-0"] == lost.group_rank
    assert all(by_id[m.node_id] == m.group_rank for m in m1.members if m.node_id != victim.handle.node_id)
    survivors = [a for a in run.agents if a is not victim]
    assert all(list(a.held) == [epoch1, epoch2] and a.roles[epoch2] == "member" for a in survivors)


def test_a_manifest_over_the_record_cap_is_refused_and_reported() -> None:
    run = RendezvousRun(N, COSTS, record_limit=2048)
    first = run.first_round(limit=600)
    assert not first["sealed"] and first["nodes_done"] == 0 and first["seconds"] is None
    assert "the limit is 2048" in first["error"]
    assert PREFIX + MANIFEST not in run.sim.mem.keys


def test_a_round_whose_manifest_exceeds_one_record_is_sealed_in_buckets_each_node_reading_its_own() -> None:
    """2,600 nodes: the manifest is over the 256 KiB record cap (such a job once never formed: the seal was
    refused before it was sent). It is sealed as a header and buckets in one transaction, for one write; every
    node but the sealer is sent the header and reads one bucket, not the manifest."""
    n = 2600
    run = RendezvousRun(n, COSTS)
    first = run.first_round(limit=600)
    assert first["error"] is None and first["sealed"] and first["nodes_done"] == n
    assert first["manifest_bytes"] > MAX_RECORD_BYTES
    (epoch, m), = run.manifests()
    assert len(m.members) == n and m.spares == ["trainjob-spare-0"] and m.world_size == 8 * n
    buckets, _ = run.sim.mem.get_prefix(PREFIX + MANIFEST_PARTS)
    assert len(buckets) == 33 and {kv.mod_revision for kv in buckets} == {epoch}
    assert written(run) == 2 * (n + 1) + 1  # the buckets and the header are one proposal
    assert first["writes"] - written(run) in (0, 1)  # and at most one seal refused by its fence (above)
    assert all(list(a.held) == [epoch] for a in run.agents)
    light = [p for p in run.procs if not p.rdzv.view().full]
    assert len(light) == n and all(len(p.rdzv.view().parts) == 1 for p in light)
    assert first["watch_bytes"] < 2 * first["manifest_bytes"] + n * 4096  # the header to each, not the list


@pytest.mark.parametrize("relay", [True, False], ids=["pods-relay", "per-rank"])
def test_restart_barrier_releases_every_rank_once_into_one_seal(relay: bool) -> None:
    # The clock charges no CPU here, so the counts are the protocol's alone: charged, a rank slowed by a loaded
    # machine can reach its relay after the pod's transaction went, and its arrival is a second one (the model's
    # right answer on that machine; a run of the suite once saw 8 writes where 7 are the protocol's).
    run = RestartRun(N, COSTS, relay=relay, cpu=False)
    res = run.restart(limit=600)
    assert res["released"] == N and res["seals"] == 1 and res["seconds"] is not None
    assert all(r.releases == 1 for r in run.ranks)
    seal = run.ranks[0].seal
    assert seal is not None and seal.iteration == 1 and seal.world_size == N
    assert all(r.seal == seal for r in run.ranks)
    assert sorted(seal.ranks.values()) == list(range(N)) and sorted(int(s) for s in seal.ranks) == list(range(N))
    # One fault report, one arrival per rank, the seal: at most 2 writes per rank. Through the pods' relays
    # (8 ranks a pod) the arrivals of a pod are one write, which reads the cause for all of them.
    pods = -(-N // 8)
    assert res["writes"] == 1 + (pods if relay else N) + 1
    assert res["writes"] / N <= 2
    assert res["relay_transactions"] == (pods if relay else 0)
    # Requests to etcd: the fault report, per pod (or rank) the arrival with the cause's read, the seal; with the
    # relays the sealer reads its parts after its arrival: this barrier's arrivals and seal and the last seal,
    # which places every slot (not the heartbeats or the last iteration's arrivals).
    assert res["requests"] == (1 + pods + 1 + 1 if relay else 1 + N + 1)
    sealer = next(r for r in run.ranks if r.sealer)
    assert sealer.parts is not None and {p.key for p in sealer.parts} == {"arrive/1/", "seal/1", "seal/0"}
    arrivals = [k for k in run.sim.mem.keys if k.startswith(run.ranks[0].coord.base + "arrive/1/")]
    assert len(arrivals) == N and res["keys_written"] == 1 + N + 1
    # No N-squared fan-out: each rank's monitor is sent the fault, the one sealer (the lowest slot of the last
    # seal) the arrivals, every other rank the seal at most once.
    assert seal.sealed_by == 0 and [r.coord.slot for r in run.ranks if r.sealer] == [0]
    assert res["watch_events"] <= N + (N - 1) + (N - 1)


def test_ranks_that_ask_their_relay_apart_are_still_released_once_into_one_seal() -> None:
    # Aborts ending up to 50 ms apart, past the relay's 20 ms linger: a pod's requests split over transactions.
    run = RestartRun(N, COSTS, abort_spread=0.05)
    res = run.restart(limit=600)
    pods = -(-N // 8)
    assert res["released"] == N and res["seals"] == 1 and all(r.releases == 1 for r in run.ranks)
    assert res["relay_transactions"] > pods
    assert res["writes"] / N <= 2 and res["keys_written"] == 1 + N + 1


def test_the_what_if_of_one_watch_per_pod_releases_every_rank_once_with_a_pods_events_once() -> None:
    plain, what_if = RestartRun(N, COSTS).restart(limit=600), RestartRun(N, COSTS, pod_fanout=True)
    res = what_if.restart(limit=600)
    pods = -(-N // 8)
    assert res["released"] == N and res["seals"] == 1 and all(r.releases == 1 for r in what_if.ranks)
    assert res["writes"] == plain["writes"]  # the same code writes the same
    # The fault to each pod's agent, a record per pod to the sealer, the seal to each pod's agent.
    assert res["watch_events"] <= 3 * pods < plain["watch_events"]


def test_the_completion_barrier_ends_every_rank_with_one_more_write() -> None:
    run = RestartRun(N, COSTS)
    res = run.complete(limit=600)
    assert res["ended"] == N and res["seconds"] is not None
    assert res["writes"] == N + 1  # a mark per rank, the END by the last
    ends = [ev for ev in run.sim.mem.log if ev.kv.key == run.ranks[0].coord.round_keys.end(0)]
    assert len(ends) == 1 and res["watch_events"] <= N - 1


def test_the_anchor_pays_a_refused_write_per_node_ahead_of_it() -> None:
    res = CasRun(N, COSTS, grow=False).run()
    assert res["nodes_done"] == N
    # Under one queue every round lets one node through: N + (N-1) + ... + 1 attempts.
    assert res["writes"] == N * (N + 1) // 2 and res["refused"] == res["writes"] - N


def test_a_background_that_needs_all_of_etcd_leaves_no_run_and_the_row_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    from bench.scale import scale_rows

    # Reads of 100 ms: the background of 50 pods (their leases, which their ranks' liveness is on, 15 refreshes a
    # second) needs 1.5 s of etcd's time a second: no re-rendezvous is simulated under it; the row says so, with
    # the one without the load beside it.
    out = scale_rows(50, Costs(rtt=0.0005, write=0.0003, read=0.1, read_byte=1e-8, event=3e-5, event_byte=5e-9),
                     anchor_max=0)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    got = {(r["impl"], r["metric"]): r for r in rows}
    assert got[("stalwart", "rerendezvous_seconds")]["value"] is None
    assert got[("stalwart", "rerendezvous_seconds")]["saturated"] == pytest.approx(1.515)
    assert got[("stalwart-no-background", "rerendezvous_seconds")]["value"] is not None
    assert out["rerendezvous"] is not None


@pytest.mark.integration
def test_the_quick_benchmark_prints_every_metric_within_the_write_budgets() -> None:
    """``bench/scale.py --quick`` as CI would run it (fixed costs instead of the calibration)."""
    root = Path(__file__).resolve().parents[2]
    costs = json.dumps(COSTS.as_dict())
    # On a run past its time the benchmark is asked for every thread's stack (faulthandler, SIGABRT) before it is
    # killed, so that the failure says where it stood.
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", str(root / "bench" / "scale.py"), "--quick",
                             "--costs", costs], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            _, err = proc.communicate(timeout=20)
        finally:
            proc.kill()
            proc.wait()
        pytest.fail(f"bench/scale.py --quick ran past 240 s; its threads' stacks:\n{err[-6000:]}")
    assert proc.returncode == 0, err[-4000:]
    rows = [json.loads(line) for line in out.splitlines()]
    assert all(r["bench"] == "scale" for r in rows)
    got = {(r["impl"], r["nodes"], r["metric"]): r for r in rows}
    for n in (50, 200):
        for metric in ("rendezvous_seconds", "writes_per_node", "restart_barrier_seconds",
                       "writes_per_rank_per_restart"):
            assert got[("stalwart", n, metric)]["value"] is not None, (n, metric)
        # Two per node and the seal; at most one seal refused by its fence beside (test_first_round_and_a_lost_node).
        assert (2 * (n + 1) + 1) / (n + 1) - 1e-6 <= got[("stalwart", n, "writes_per_node")]["value"] <= \
            (2 * (n + 1) + 2) / (n + 1) + 1e-6
        pods = -(-n // 8)
        assert got[("stalwart", n, "writes_per_rank_per_restart")]["value"] == pytest.approx((pods + 2) / n, abs=1e-6)
        assert got[("stalwart-per-rank", n, "writes_per_rank_per_restart")]["value"] == \
            pytest.approx((n + 2) / n, abs=1e-6)
        assert got[("anchor-cas", n, "writes_per_node")]["value"] == pytest.approx((n + 1) / 2)
        # The project's code is charged its CPU, phase by phase; the run without the charge is printed beside.
        phases = {(r["what"], r["phase"]): r["value"] for r in rows if r["metric"] == "cpu_seconds" and r["nodes"] == n}
        assert set(phases) == {("rendezvous", "driver"), *(("restart", p) for p in
                                                          ("arrive", "relay", "sealer", "wait"))}
        assert all(v > 0 for v in phases.values()), phases
        charged = got[("stalwart", n, "restart_barrier_seconds")]
        assert charged["cpu_charged"] is True and charged["background"] is True
        assert got[("stalwart-no-background", n, "restart_barrier_seconds")]["background"] is False
        uncharged = got[("stalwart-uncharged", n, "restart_barrier_seconds")]
        assert uncharged["cpu_charged"] is False and uncharged["background"] is False
        # The background: the pod's own lease, which its ranks' liveness is on, every TTL/3 (10 s), and a progress
        # write a second; a lease per pod beside the node's, or a lease per rank, cost more.
        bg = next(r for r in rows if r["metric"] == "background_requests_per_second" and r["nodes"] == n
                  and r["what"] == "restart")
        assert bg["rank_lease_refresh"] == 0.0
        assert bg["value"] == pytest.approx(pods * 0.3 + pods, abs=0.1)
        apart = got[("stalwart-pod-leases-apart", n, "restart_barrier_seconds")]["background_busy"]
        assert got[("stalwart-rank-leases", n, "restart_barrier_seconds")]["background_busy"] > apart > \
            charged["background_busy"]
    # With these costs (a read 2 ms) the background of 200 nodes of 8 ranks takes 18% of etcd's time (their leases'
    # 60 refreshes a second 0.12 s, their progress writes 0.06 s; 30% with a lease for the ranks beside each node's,
    # 1.14 s a second, more than all of it, with a lease per rank): the re-rendezvous runs under it.
    for n in (50, 200):
        assert got[("stalwart", n, "rerendezvous_seconds")]["value"] is not None
        assert got[("stalwart", n, "rerendezvous_seconds")]["background"] is True
    busy = next(r for r in rows if r["metric"] == "background_requests_per_second" and r["nodes"] == 200
                and r["what"] == "rerendezvous")["server_busy_fraction"]
    assert busy == pytest.approx(0.18)
    # The model counts the writes the real driver makes on the real server (a retried seal at most apart).
    real = got[("validate-real-etcd", 50, "writes_per_node")]["value"]
    assert got[("validate-sim", 50, "writes_per_node")]["value"] == pytest.approx(101 / 50)
    assert abs(round(real * 50) - 101) <= 1  # in whole writes: 100/50 - 101/50 is not exactly 1/50 in floats
