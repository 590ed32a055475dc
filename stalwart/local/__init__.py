"""The local cluster: what stalwart runs on for development, CI and the demo where no Kubernetes cluster is at hand.

Production is real Kubernetes. Locally, ``stalwart local up --dir DIR`` starts, all on loopback:

- a real etcd (:mod:`.etcd`), for the jobs' rendezvous;
- a Kubernetes API emulator (:mod:`.apiserver`) that the real kopf, kubernetes client, kubectl and Helm library
  use unmodified, through ``DIR/kubeconfig``;
- a process kubelet (:mod:`.kubelet`) that runs each pod's containers as local processes, one loopback address
  per pod, on a few virtual nodes that can be lost (killed or partitioned) for fault tests;
- a scheduler with resource fit per node (:mod:`.scheduler`), the node lifecycle, taint eviction and pod GC
  controllers (:mod:`.nodelifecycle`), the DefaultTolerationSeconds admission plugin (:mod:`.admission`), and the
  Deployment and ServiceAccount controllers (:mod:`.controllers`); node capacity and timings:
  :mod:`.settings`.

:mod:`.cluster` starts, finds and stops it (:class:`~stalwart.local.cluster.LocalCluster`);
:mod:`.pytest_plugin` offers it to tests as the session fixture ``local_cluster``.

What it does not do: container images, volumes, networking between pods beyond loopback (no Service
virtual IPs or cluster DNS), ``kubectl exec``/``port-forward``/``attach``, authentication and authorization,
admission webhooks, and protobuf request bodies other than those of Secret, ConfigMap, Namespace, ServiceAccount
and DeleteOptions (so ``kubectl create deployment`` and other imperative creators of typed objects are refused
with 415; ``kubectl apply``/``create -f`` send JSON and work).
"""
