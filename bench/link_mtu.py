"""What the local cluster's link MTU does to a copy between two nodes, against the same copy over loopback (the
anchor: where torchft's and torchrun's processes talk in this project's benchmarks).

Per ``--mtus`` value: a network of two nodes as the local cluster makes it (:class:`NodeNetwork`: a bridge,
a network namespace per node joined by a veth pair, every link at that MTU); in each namespace one process
(``ip netns exec``) joins a two-rank gloo group on its node's address, and rank 0 sends rank 1 ``--mb`` MB
in 8 MB messages, four in flight (as ``sync_from_peers`` does), into memory rank 1 touched before (so the
figure is the wire's, not the page allocator's). The anchor is the same two processes on 127.0.0.1. Each
round runs every case once, in turn.

Rows: ``{"bench": "link_mtu", "impl": "netns" | "loopback", "mtu", "metric": "gbps", "value", "rounds",
"seconds", "bytes"}`` (``value``: the median round's 1e9 bytes a second), then ``"metric": "ratio"``: each
MTU's median over loopback's. Not charged: the group's construction, the namespaces' creation. Needs root.

Run: ``.venv/bin/python bench/link_mtu.py [--mtus 1500 9000 65535] [--mb 800] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MESSAGE = 8 << 20
WINDOW = 4
PORT = 29731
DEADLINE_S = 300.0


def worker(rank: int, address: str, port: int, nbytes: int, interface: str) -> None:
    """One rank: rank 0 sends ``nbytes``, rank 1 receives them and prints the seconds it took."""
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2)
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier()
    began = time.perf_counter()
    works = []
    for i, at in enumerate(range(0, nbytes, MESSAGE)):
        part = buf[at:at + MESSAGE]
        works.append(dist.isend(part, 1, tag=i) if rank == 0 else dist.irecv(part, 0, tag=i))
        if len(works) > WINDOW:
            works.pop(0).wait()
    for w in works:
        w.wait()
    seconds = time.perf_counter() - began
    if rank == 1:
        if not bool(buf.all()):
            raise SystemExit("link_mtu: the received bytes differ from the sent ones")
        print(json.dumps({"seconds": seconds}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _pair(prefixes: tuple[list[str], list[str]], address: str, nbytes: int, interface: str, port: int) -> float:
    """Run the two ranks (each command prefixed, e.g. by ``ip netns exec NS``) and return the receiver's seconds."""
    me = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    procs = [subprocess.Popen([*prefixes[r], *me, str(r), address, str(port), str(nbytes), interface],
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=DEADLINE_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    codes = [p.returncode for p in procs]
    if codes != [0, 0]:
        raise RuntimeError(f"link_mtu: a rank failed (exit codes {codes})")
    return float(json.loads(outs[1].strip().splitlines()[-1])["seconds"])


def run(mtus: list[int], nbytes: int, rounds: int) -> list[dict[str, object]]:
    from stalwart.local.netns import NodeNetwork

    cases: list[tuple[str, int]] = [("loopback", 65536), *(("netns", m) for m in mtus)]
    seconds: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory(prefix="link-mtu-") as tmp:
        networks: dict[int, NodeNetwork] = {}
        try:
            for m in mtus:
                (Path(tmp) / str(m)).mkdir()
                networks[m] = NodeNetwork.create(Path(tmp) / str(m), ["a", "b"], mtu=m)
            for r in range(rounds):
                for impl, mtu in cases:
                    port = PORT + r
                    if impl == "loopback":
                        took = _pair(([], []), "127.0.0.1", nbytes, "lo", port)
                    else:
                        plan = networks[mtu].plan
                        prefixes = (["ip", "netns", "exec", plan.netns("a")], ["ip", "netns", "exec", plan.netns("b")])
                        took = _pair(prefixes, plan.node_ip("a"), nbytes, "eth0", port)
                    seconds[impl, mtu].append(took)
        finally:
            for net in networks.values():
                net.remove()
    rows: list[dict[str, object]] = []
    medians = {c: statistics.median(s) for c, s in seconds.items()}
    for impl, mtu in cases:
        rows.append({"bench": "link_mtu", "impl": impl, "mtu": mtu, "metric": "gbps",
                     "value": round(nbytes / medians[impl, mtu] / 1e9, 3),
                     "rounds": [round(nbytes / s / 1e9, 3) for s in seconds[impl, mtu]],
                     "seconds": round(medians[impl, mtu], 4), "bytes": nbytes})
    for mtu in mtus:
        rows.append({"bench": "link_mtu", "impl": "netns", "mtu": mtu, "metric": "ratio", "anchor": "loopback",
                     "value": round(medians["loopback", 65536] / medians["netns", mtu], 3)})
    return rows


def main(argv: list[str] | None = None) -> None:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--worker"]:
        rank, address, port, nbytes, interface = args_in[1:6]
        worker(int(rank), address, int(port), int(nbytes), interface)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--mtus", type=int, nargs="+", default=[1500, 9000, 65535])
    parser.add_argument("--mb", type=int, default=800, help="megabytes (2**20) per copy")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(args_in)
    if args.mb < 1 or args.rounds < 1:
        parser.error("--mb and --rounds: expected >= 1")
    from stalwart.local.netns import missing_rights
    from stalwart.local.netplan import PlanError

    reason = missing_rights()
    if reason:
        parser.error(f"a network namespace per node needs root: {reason}")
    try:
        rows = run(args.mtus, args.mb << 20, args.rounds)
    except PlanError as e:
        parser.error(f"--mtus: {e}")
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
