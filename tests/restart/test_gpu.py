"""The CUDA paths: NCCL process groups aborted and rebuilt in process, and the CUDA health check.

Marked ``gpu``: skipped where CUDA is absent, run on a machine with one (two ranks need two GPUs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from restart_helpers import expected_checksum, run_ranks

from stalwart.local.etcd import EtcdServer
from stalwart.restart import CudaHealthCheck, IterationContext

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def test_cuda_health_check_passes_on_a_healthy_device() -> None:
    CudaHealthCheck(timeout=60)(IterationContext(iteration=0, slot=0, rank=0, world_size=1, store=None))


def test_nccl_one_rank_restarts_in_process(etcd: EtcdServer, tmp_path: Path) -> None:
    run = run_ranks(etcd, tmp_path, "--steps", "8", "--backend", "nccl", "--fault", "exception",
                    "--fault-rank", "0", "--fault-step", "3", slots=1)
    assert run.codes == [0], run.stderr
    [r] = run.results
    assert r["step"] == 8 and r["restarts"] == 1
    assert r["checksum"] == pytest.approx(expected_checksum(steps=8, ranks=1), abs=1e-4)


def test_nccl_two_ranks_abort_frees_the_blocked_peer(etcd: EtcdServer, tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("two ranks over NCCL need two GPUs")
    run = run_ranks(etcd, tmp_path, "--steps", "8", "--backend", "nccl", "--fault", "exception",
                    "--fault-step", "3", "--timeout", "600")
    assert run.codes == [0, 0], run.stderr
    for r in run.results:
        assert r["step"] == 8 and r["restarts"] == 1
        assert r["checksum"] == pytest.approx(expected_checksum(steps=8), abs=1e-4)
