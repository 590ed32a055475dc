"""A rank process for the tests: bootstraps a gloo group through the etcd torch Store, all-reduces, reports.

Usage: python gloo_worker.py ENDPOINT NAMESPACE UID EPOCH RANK WORLD_SIZE OUT_FILE
Writes a JSON line {"rank":..., "sum":...} on success or {"rank":..., "error": "<type>: <message>"}.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta


def main() -> int:
    endpoint, namespace, uid, epoch, rank, world, out = sys.argv[1:8]
    import torch
    import torch.distributed as dist

    from stalwart.agent.rendezvous import EtcdTorchStore
    from stalwart.etcd.keys import JobKeys
    from stalwart.etcd.store import Store

    etcd = Store([endpoint], timeout=10)
    result: dict[str, object] = {"rank": int(rank)}
    try:
        store = EtcdTorchStore(etcd, JobKeys(namespace, uid), int(epoch), timeout=60)
        dist.init_process_group("gloo", store=store, rank=int(rank), world_size=int(world),
                                timeout=timedelta(seconds=60))
        t = torch.tensor([float(int(rank) + 1)])
        dist.all_reduce(t)
        result["sum"] = float(t.item())
        dist.destroy_process_group()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        f.write(json.dumps(result) + "\n")
    etcd.close()
    return 0 if "sum" in result else 1


if __name__ == "__main__":
    sys.exit(main())
