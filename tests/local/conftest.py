"""The local cluster's fixtures, for this directory (see stalwart.local.pytest_plugin)."""

from stalwart.local.pytest_plugin import k8s_namespace, kube_api, local_cluster

__all__ = ["k8s_namespace", "kube_api", "local_cluster"]
