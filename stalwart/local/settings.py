"""What a local cluster is made of and how fast its control loops react: each virtual node's capacity and the
timings of node loss. ``stalwart local up`` flags and ``LocalCluster.up(settings=...)`` set them; the control
plane receives them as JSON.

The defaults are those of a real cluster where one exists (node-monitor grace period 40 s, default
tolerations of 300 s, 110 pods per node); tests shorten the timings. Node capacities are fixed numbers rather
than this machine's, so that what schedules is the same on every machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stalwart.local.quantity import QuantityError, parse_quantity

#: The extended resource name of NVIDIA's device plugin.
GPU_RESOURCE = "nvidia.com/gpu"


#: How the nodes reach each other (see ``LocalClusterSettings.network``).
NetworkMode = Literal["auto", "netns", "loopback"]


class LocalClusterSettings(BaseModel):
    """Capacity of every virtual node, the node-loss timings (seconds) and the network mode."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_cpu: str = Field("8", description="CPU capacity of each node (a quantity: 8, 500m)")
    node_memory: str = Field("32Gi", description="memory capacity of each node (a quantity: 32Gi)")
    node_gpus: int = Field(0, ge=0, description="nvidia.com/gpu capacity of each node")
    node_pods: int = Field(110, ge=1, description="how many pods each node runs at most")
    node_monitor_grace_period: float = Field(
        40.0, gt=0, description="seconds without a kubelet heartbeat before a node's Ready turns Unknown")
    default_not_ready_toleration_seconds: int = Field(
        300, ge=0, description="tolerationSeconds of the node.kubernetes.io/not-ready toleration pods get")
    default_unreachable_toleration_seconds: int = Field(
        300, ge=0, description="tolerationSeconds of the node.kubernetes.io/unreachable toleration pods get")
    network: NetworkMode = Field(
        "auto", description="netns: a network namespace per node (root only); loopback: every pod on this "
                            "machine's loopback; auto: netns where this process may make namespaces, else loopback")

    @field_validator("node_cpu", "node_memory")
    @classmethod
    def _quantity(cls, value: str) -> str:
        try:
            amount = parse_quantity(value)
        except QuantityError as exc:
            raise ValueError(str(exc)) from None
        if amount <= 0:
            raise ValueError(f"{value!r}: expected a positive quantity")
        return value

    @property
    def node_monitor_period(self) -> float:
        """How often the node lifecycle controller looks (kube-controller-manager: 5 s)."""
        return min(5.0, self.node_monitor_grace_period / 4)

    @property
    def lease_renew_interval(self) -> float:
        """How often a kubelet renews its node Lease (a real kubelet: 10 s, a quarter of the 40 s lease)."""
        return min(10.0, self.node_monitor_grace_period / 4)

    def capacity(self) -> dict[str, str]:
        """A node's ``status.capacity`` (and ``allocatable``: nothing is reserved for the system here)."""
        out = {"cpu": self.node_cpu, "memory": self.node_memory, "pods": str(self.node_pods),
               "ephemeral-storage": "100Gi"}
        if self.node_gpus:
            out[GPU_RESOURCE] = str(self.node_gpus)
        return out


#: The variable that picks the nodes' network for a test session or a benchmark's cluster.
NETWORK_ENV = "STALWART_LOCAL_NETWORK"
_MODES: tuple[NetworkMode, ...] = get_args(NetworkMode)


def network_from_env(environ: Mapping[str, str] = os.environ) -> NetworkMode:
    """The network mode ``$STALWART_LOCAL_NETWORK`` names (``auto`` when unset), so that a suite or a benchmark
    can run its clusters in either mode; a value that names none is refused, naming the variable."""
    value = environ.get(NETWORK_ENV, "auto")
    if value not in _MODES:
        raise ValueError(f"{NETWORK_ENV}: expected one of {', '.join(_MODES)}, got {value!r}")
    return value
