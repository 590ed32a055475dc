"""Which tests share an xdist worker (``--dist loadgroup``; tests/conftest.py marks them)."""

from __future__ import annotations

#: xdist groups (``--dist loadgroup``, by module path: tests/conftest.py's scheduler): the tests of a group run on
#: one worker, in file order. The RBAC record
#: test_zz_rbac.py checks is of its worker's cluster, and must hold a use of every grant of rbac.py: the modules
#: of RBAC_GROUP between them use every one (pods get: test_adoption.py; peering, PodGroups and the TTL's delete:
#: test_operator_cluster.py), so they run on that worker. The other tests of the chart's account (warm spares,
#: node loss: the slowest of the suite) run anywhere; each worker's record is still checked at its session's end
#: (nothing refused, nothing rbac.py lacks: the ``operator_account`` fixture). The e2e installation
#: (``stalwart_install``) is one cluster per worker that asks for it, so the modules using it share one.
RBAC_GROUP = "operator-rbac"
GROUP_MODULES = {
    **{f"tests/operator/{m}.py": RBAC_GROUP for m in (
        "test_adoption", "test_operator_cluster", "test_secure_etcd", "test_job_etcd_policy", "test_zz_rbac")},
    **{f"tests/e2e/{m}.py": "e2e-install" for m in ("test_e2e", "test_drill", "test_zz_peering")},
    # Its module fixture runs four FSDP2 rank processes through every scenario at once (about 30 s): once, on
    # one worker, not once on each worker that draws one of its tests.
    "tests/restart/test_snapshots.py": "snapshots",
    # Its fault-free reference run (four rank processes) serves both of its cluster tests.
    "tests/operator/test_sharded_pod_loss.py": "sharded",
}
