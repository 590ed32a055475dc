"""The training script of the torchrun test: a gloo all-reduce, then a JSON report per rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    report = {"rank": rank, "world_size": world, "sum": float(t.item()),
              "group_rank": int(os.environ["GROUP_RANK"])}
    Path(os.environ["OUT_DIR"], f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
