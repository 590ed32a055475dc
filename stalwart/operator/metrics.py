"""The operator's Prometheus metrics (served by ``stalwart operator --metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

JOBS = Gauge("stalwart_operator_jobs", "TrainingJobs this operator reconciles, by phase.", ["phase"])
RESTARTS = Counter("stalwart_operator_restarts_total",
                   "Recoveries across jobs, by kind: in_process (every rank kept its process) or process (rank "
                   "processes started again). Pod replacements are stalwart_operator_pod_replacements_total.",
                   ["kind"])
POD_REPLACEMENTS = Counter("stalwart_operator_pod_replacements_total",
                           "Pods replaced after a failure or loss (counted against backoffLimit).")
RECONCILE_SECONDS = Histogram(
    "stalwart_operator_reconcile_seconds", "Time of one reconcile: observe, decide, apply.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
POD_BATCH_SECONDS = Histogram(
    "stalwart_operator_pod_batch_seconds",
    "Time to create one reconcile's batch of pods (issued concurrently), from the first call to the last reply.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
API_CALLS = Counter("stalwart_operator_api_calls_total", "Kubernetes API calls made by the operator.",
                    ["verb", "resource"])
API_ERRORS = Counter("stalwart_operator_api_errors_total",
                     "Kubernetes API calls that failed (404 on delete and 409 on create are not errors).",
                     ["verb", "resource"])
ETCD_ERRORS = Counter("stalwart_operator_etcd_errors_total", "etcd operations of the operator that failed.",
                      ["operation"])
