"""The chart's Grafana dashboard, PrometheusRule and the agents' PodMonitor: rendered only when asked for (the rule
and the PodMonitor only where their API exists), and every query built on the metrics the operator and the jobs'
agents serve (stalwart/operator/metrics.py, stalwart/agent/metrics.py): no metric name and no label that they do
not expose."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import helm_python
import kubernetes_validate
import pytest
from helm_render import CHART_DIR, NAMESPACE, Render, find, one
from prometheus_client.metrics import MetricWrapperBase

from stalwart.agent.metrics import AgentMetrics
from stalwart.api import naming
from stalwart.cli import build_parser
from stalwart.operator import metrics
from stalwart.operator.manifests import AGENT_METRICS_PORT_NAME

MONITORING = ["monitoring.coreos.com/v1"]
DASHBOARD = CHART_DIR / "dashboards" / "stalwart.json"
ENABLED: dict[str, Any] = {"metrics": {"enabled": True, "dashboard": {"enabled": True},
                                       "prometheusRule": {"enabled": True}}}
# Labels every series the chart's ServiceMonitor scrapes carries besides its own (the Prometheus Operator sets job
# to the Service's name and namespace to the target's). The alerts use them to select this release's operator; the
# dashboard, which has no variable for them, does not.
TARGET_LABELS = frozenset({"job", "namespace"})
# The pods' job-name label as Prometheus names it once the PodMonitor's podTargetLabels copy it onto the agents'
# series: a label name keeps only [a-zA-Z0-9_], anything else becomes "_".
JOB_NAME_TARGET_LABEL = re.sub(r"[^a-zA-Z0-9_]", "_", naming.LABEL_JOB_NAME)
# Labels every series the chart's PodMonitor scrapes carries besides its own: job (<PodMonitor namespace>/<its
# name>), the pod's namespace and name, and the job-name label of podTargetLabels.
AGENT_TARGET_LABELS = frozenset({"job", "namespace", "pod", JOB_NAME_TARGET_LABEL})
#: The alerts on the agents' series (rendered with metrics.agents.enabled).
AGENT_ALERTS = ("StalwartSlowRecovery", "StalwartPeerSnapshotStale")
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def series_of(collectors: Iterable[object]) -> dict[str, frozenset[str]]:
    """Each series name the given collectors expose -> its labels (objects that are no collector are skipped).

    prometheus_client keeps a Counter's name without ``_total`` and exposes ``<name>_total``; a Histogram
    ``<name>`` exposes ``<name>_bucket`` (with ``le``), ``<name>_sum`` and ``<name>_count`` (``_created``
    series, exposed too, are no use in a query and left out). The label names have no public accessor."""
    series: dict[str, frozenset[str]] = {}
    for collector in collectors:
        if not isinstance(collector, MetricWrapperBase):
            continue
        (family,) = collector.describe()
        labels = frozenset(collector._labelnames)
        for suffix in SUFFIXES[family.type]:
            series[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return series


def agent_series() -> dict[str, frozenset[str]]:
    """Each series name a job's agent exposes -> its labels, from the collectors of an AgentMetrics (each in the
    instance's own registry)."""
    return series_of(vars(AgentMetrics()).values())


def exposed_series() -> dict[str, frozenset[str]]:
    """Each series name the operator (the collectors of stalwart.operator.metrics) or an agent exposes -> its
    labels."""
    operator = series_of(vars(metrics).values())
    agents = agent_series()
    assert not operator.keys() & agents.keys(), "the operator and the agents expose a series of the same name"
    return operator | agents


SERIES = exposed_series()
AGENT_SERIES = frozenset(agent_series())
# A series name: stalwart_..., except the job-name target label (stalwart_dev_job_name), which is none.
STALWART = re.compile(rf"\b(?!{JOB_NAME_TARGET_LABEL}\b)stalwart_[a-z_]+")
SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for labels in GROUPING.findall(expr) for label in labels.split(",") if label.strip()}


def problems(expr: str, extra_labels: frozenset[str] = frozenset()) -> list[str]:
    """What in a PromQL expression the operator's metrics do not have: an unknown ``stalwart_`` series, a
    matcher on a label the series lacks, a by/without/on/ignoring label that one of its series lacks."""
    found: list[str] = []
    names = STALWART.findall(expr)
    if not names:
        found.append(f"no stalwart metric in {expr!r}")
    for name in names:
        if name not in SERIES:
            found.append(f"{name} is no series the operator exposes")
    for name, matchers in SELECTOR.findall(expr):
        if name in SERIES:
            for label in MATCHER.findall(matchers):
                if label not in SERIES[name] | extra_labels:
                    found.append(f"{name} has no label {label}")
    for label in grouping_labels(expr):
        for name in names:
            if name in SERIES and label not in SERIES[name] | extra_labels:
                found.append(f"{name} has no label {label} (grouped by in {expr!r})")
    if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}") \
            or expr.count("[") != expr.count("]"):
        found.append(f"unbalanced brackets in {expr!r}")
    return found


def dashboard_targets() -> list[tuple[str, dict[str, Any]]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rule = one(docs, "PrometheusRule", "-operator")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_the_checker_catches_what_the_operator_does_not_expose() -> None:
    assert SERIES["stalwart_operator_restarts_total"] == {"kind"}
    assert SERIES["stalwart_operator_reconcile_seconds_bucket"] == {"le"}
    assert "stalwart_operator_restarts" not in SERIES and "stalwart_operator_reconcile_seconds" not in SERIES
    assert problems("sum by (kind) (rate(stalwart_operator_restarts_total[5m]))") == []
    assert problems("rate(stalwart_operator_restart_total[5m])")  # a misspelt name
    assert problems("stalwart_operator_jobs{kind=\"Failed\"}")  # a label of another metric
    assert problems("sum by (le) (rate(stalwart_operator_reconcile_seconds_sum[5m]))")  # le is on _bucket only
    assert problems("sum by (verb) (rate(stalwart_operator_etcd_errors_total[5m]))")
    assert problems("stalwart_operator_jobs{job=\"x\"}")
    assert problems("stalwart_operator_jobs{job=\"x\"}", TARGET_LABELS) == []


def test_dashboard_is_a_grafana_dashboard_on_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] == 39 and dashboard["uid"] and dashboard["title"]
    (variable,) = dashboard["templating"]["list"]
    assert variable == variable | {"name": "datasource", "type": "datasource", "query": "prometheus"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]


def test_dashboard_has_the_panels_of_every_metric() -> None:
    exprs = " ".join(target["expr"] for _, target in dashboard_targets())
    used = set(STALWART.findall(exprs))
    assert {"stalwart_operator_jobs", "stalwart_operator_restarts_total", "stalwart_operator_pod_replacements_total",
            "stalwart_operator_reconcile_seconds_bucket", "stalwart_operator_pod_batch_seconds_bucket",
            "stalwart_operator_api_calls_total", "stalwart_operator_api_errors_total",
            "stalwart_operator_etcd_errors_total"} <= used
    for quantile in ("0.5", "0.99"):
        for histogram in ("reconcile_seconds", "pod_batch_seconds"):
            assert f"histogram_quantile({quantile}, sum by (le) (rate(stalwart_operator_{histogram}_bucket" in exprs


@pytest.mark.parametrize(("title", "target"), dashboard_targets(),
                         ids=[f"{title}-{target['refId']}" for title, target in dashboard_targets()])
def test_dashboard_queries_use_only_what_the_operator_exposes(title: str, target: dict[str, Any]) -> None:
    assert problems(target["expr"]) == []
    # A legend names only labels the query keeps.
    for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
        assert label in grouping_labels(target["expr"]), f"{title}: the legend shows {label}, which the query drops"


def test_defaults_render_no_dashboard_and_no_rule(render: Render) -> None:
    for api_versions in (None, MONITORING):
        docs = render(None, api_versions)
        assert find(docs, "ConfigMap") == [] and find(docs, "PrometheusRule") == []
    # Without metrics the operator serves none: neither is rendered, whatever else is set.
    off = {"metrics": ENABLED["metrics"] | {"enabled": False}}
    docs = render(off, MONITORING)
    assert find(docs, "ConfigMap") == [] and find(docs, "PrometheusRule") == []


def test_dashboard_configmap_carries_the_dashboard_for_grafanas_sidecar(render: Render) -> None:
    docs = render({"metrics": {"enabled": True, "dashboard": {"enabled": True, "labels": {"team": "ml"}}}})
    configmap = one(docs, "ConfigMap", "-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["labels"]["team"] == "ml"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert json.loads(configmap["data"]["stalwart.json"]) == json.loads(DASHBOARD.read_text())
    for version in ("1.29.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(configmap, version, strict=True)
    assert find(docs, "PrometheusRule") == []


def test_prometheus_rule_only_where_its_api_is_served(render: Render) -> None:
    assert find(render(ENABLED), "PrometheusRule") == []
    docs = render(ENABLED, MONITORING)
    rule = one(docs, "PrometheusRule", "-operator")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"


def test_alerts_use_only_what_the_operator_exposes(render: Render) -> None:
    docs = render(ENABLED, MONITORING)
    alerts = rules(docs)
    assert [r["alert"] for r in alerts] == ["StalwartJobFailed", "StalwartJobRestartingTooLong",
                                            "StalwartHighRestartRate", "StalwartOperatorAPIErrors",
                                            "StalwartOperatorEtcdErrors", "StalwartOperatorDown",
                                            "StalwartSlowRecovery", "StalwartPeerSnapshotStale"]
    service = one(docs, "Service", "-operator-metrics")["metadata"]["name"]
    target = f'job="{service}", namespace="{NAMESPACE}"'
    monitor = one(docs, "PodMonitor", "-agents")["metadata"]
    agents_target = f'job="{monitor["namespace"]}/{monitor["name"]}"'
    for alert in alerts:
        expr = alert["expr"]
        if alert["alert"] in AGENT_ALERTS:
            # The agents' series, as the chart's PodMonitor scrapes them (job=<its namespace>/<its name>).
            assert problems(expr, AGENT_TARGET_LABELS) == [], alert["alert"]
            for name, matchers in SELECTOR.findall(expr):
                assert name in AGENT_SERIES and matchers == agents_target, f"{name} is not this release's agents'"
            assert STALWART.findall(expr) == [name for name, _ in SELECTOR.findall(expr)], alert["alert"]
            continue
        if alert["alert"] == "StalwartOperatorDown":
            # The scrape's own series, of the Service the ServiceMonitor scrapes (its job label).
            assert expr == f"up{{{target}}} == 0"
            continue
        assert problems(expr, TARGET_LABELS) == [], alert["alert"]
        # Every series of the alert is this release's operator's.
        for name, matchers in SELECTOR.findall(expr):
            assert name not in AGENT_SERIES, f"{alert['alert']}: {name} is an agent's series"
            assert target in matchers, f"{alert['alert']}: {name} is not scoped to this release's operator"
        assert STALWART.findall(expr) == [name for name, _ in SELECTOR.findall(expr)], alert["alert"]


def test_every_alert_has_severity_summary_description_and_known_labels(render: Render) -> None:
    for alert in rules(render(ENABLED, MONITORING)):
        name = alert["alert"]
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert alert["annotations"]["summary"].strip() and alert["annotations"]["description"].strip(), name
        assert re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", alert["for"]), name
        # An annotation shows only labels the alert's series keep.
        kept = grouping_labels(alert["expr"]) | ({"instance"} if name == "StalwartOperatorDown" else set())
        for text in alert["annotations"].values():
            for label in re.findall(r"\$labels\.(\w+)", text):
                assert label in kept, f"{name} shows $labels.{label}, which its expression drops"


def test_alert_thresholds_come_from_the_values(render: Render) -> None:
    values = {"metrics": ENABLED["metrics"] | {"prometheusRule": {"enabled": True, "restartingFor": "30m",
                                                                  "restartRate": 2.5,
                                                                  "labels": {"release": "prom"}}}}
    docs = render(values, MONITORING)
    by_name = {r["alert"]: r for r in rules(docs)}
    assert by_name["StalwartJobRestartingTooLong"]["for"] == "30m"
    assert by_name["StalwartHighRestartRate"]["expr"].endswith("[1h])) > 2.5")
    assert one(docs, "PrometheusRule")["metadata"]["labels"]["release"] == "prom"
    defaults = {r["alert"]: r for r in rules(render(ENABLED, MONITORING))}
    assert defaults["StalwartJobRestartingTooLong"]["for"] == "10m"
    assert defaults["StalwartHighRestartRate"]["expr"].endswith("[1h])) > 6")


@pytest.mark.parametrize(("values", "message"), [
    ({"metrics": {"prometheusRule": {"restartingFor": "ten minutes"}}}, "/metrics/prometheusRule/restartingFor"),
    ({"metrics": {"prometheusRule": {"restartRate": -1}}}, "/metrics/prometheusRule/restartRate"),
    ({"metrics": {"prometheusRule": {"enable": True}}}, "'enable' not allowed"),
    ({"metrics": {"dashboard": {"enabled": "yes"}}}, "/metrics/dashboard/enabled"),
    ({"metrics": {"agents": {"port": 0}}}, "/metrics/agents/port"),
    ({"metrics": {"agents": {"port": 65536}}}, "/metrics/agents/port"),
    ({"metrics": {"agents": {"enabled": "yes"}}}, "/metrics/agents/enabled"),
    ({"metrics": {"agents": {"podMonitor": {"interval": "30 seconds"}}}}, "/metrics/agents/podMonitor/interval"),
    ({"metrics": {"agents": {"podMonitor": {"scrapeTimeout": "10"}}}}, "/metrics/agents/podMonitor/scrapeTimeout"),
    ({"metrics": {"agents": {"podMonitor": {"labels": {"release": 1}}}}}, "/metrics/agents/podMonitor/labels"),
    ({"metrics": {"agents": {"podmonitor": {}}}}, "'podmonitor' not allowed"),
    ({"metrics": {"prometheusRule": {"recoverySeconds": -1}}}, "/metrics/prometheusRule/recoverySeconds"),
    ({"metrics": {"prometheusRule": {"recoverySeconds": "60s"}}}, "/metrics/prometheusRule/recoverySeconds"),
    ({"metrics": {"prometheusRule": {"snapshotAgeSeconds": -1}}}, "/metrics/prometheusRule/snapshotAgeSeconds"),
])
def test_schema_refuses_bad_monitoring_values(chart: helm_python.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.validate_schema(values)
    assert message in str(err.value)


def test_lint_is_clean_with_dashboard_and_rule() -> None:
    report = helm_python.lint(CHART_DIR, ENABLED, strict=True, namespace=NAMESPACE, kube_version="v1.29.0")
    problems_ = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems_ == [], problems_ or report["errors"]


# ---- The jobs' agents: their metrics, the PodMonitor that scrapes them, their panels and alert. ----

AGENTS: dict[str, Any] = {"metrics": {"enabled": True}}


def agent_monitor(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "PodMonitor", "-agents")


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    (container,) = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"]
    args: list[str] = container["args"]
    return args


def test_the_checker_knows_the_agents_series() -> None:
    assert SERIES["stalwart_agent_rendezvous_rounds_total"] == {"kept"}
    assert SERIES["stalwart_agent_restarts_total"] == {"tier"}
    assert SERIES["stalwart_agent_recovery_seconds_bucket"] == {"kind", "le"}
    assert SERIES["stalwart_agent_recovery_phase_seconds_bucket"] == {"kind", "phase", "le"}
    assert SERIES["stalwart_agent_recovery_seconds_count"] == {"kind"}
    assert {name for name in SERIES if name.startswith("stalwart_agent_")} == AGENT_SERIES
    assert problems("sum by (tier) (rate(stalwart_agent_restarts_total[5m]))") == []
    assert problems("sum by (kind) (rate(stalwart_agent_restarts_total[5m]))")  # the operator's label
    assert problems("rate(stalwart_agent_restart_total[5m])")  # a misspelt name
    assert problems("sum by (phase) (rate(stalwart_agent_recovery_seconds_bucket[5m]))")  # phase: the other one's
    assert JOB_NAME_TARGET_LABEL == "stalwart_dev_job_name"
    grouped = f"sum by (le, {JOB_NAME_TARGET_LABEL}) (rate(stalwart_agent_recovery_seconds_bucket[1h]))"
    assert problems(grouped) and problems(grouped, AGENT_TARGET_LABELS) == []


def test_dashboard_has_the_agents_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert "Agents" in [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    exprs = " ".join(target["expr"] for _, target in dashboard_targets())
    assert AGENT_SERIES & set(STALWART.findall(exprs)) == {
        "stalwart_agent_restarts_total", "stalwart_agent_rendezvous_rounds_total",
        "stalwart_agent_recovery_seconds_bucket", "stalwart_agent_recovery_phase_seconds_bucket",
        "stalwart_agent_peer_snapshot_step", "stalwart_agent_peer_snapshot_timestamp_seconds"}
    # A pod without snapshots reports 0: shown as no snapshot, not as one taken in 1970.
    assert "time() - (stalwart_agent_peer_snapshot_timestamp_seconds > 0)" in exprs
    assert "sum by (tier) (rate(stalwart_agent_restarts_total[" in exprs
    assert "sum by (kept) (rate(stalwart_agent_rendezvous_rounds_total[" in exprs
    for quantile in ("0.5", "0.9"):
        assert f"histogram_quantile({quantile}, sum by (le, kind) (rate(stalwart_agent_recovery_seconds_bucket[" \
            in exprs
    assert "histogram_quantile(0.9, sum by (le, phase) (rate(stalwart_agent_recovery_phase_seconds_bucket[" in exprs
    # No two panels of the grid overlap.
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_agents_pod_monitor_scrapes_every_job_pod(render: Render) -> None:
    values = {"metrics": {"enabled": True, "agents": {"podMonitor": {"labels": {"release": "prom"}}}}}
    monitor = agent_monitor(render(values, MONITORING))
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"] == "demo-stalwart-agents" and monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"
    spec = monitor["spec"]
    assert spec["selector"] == {"matchExpressions": [{"key": naming.LABEL_JOB_NAME, "operator": "Exists"}]}
    # Every pod the operator makes for a job, worker or spare, carries the label the PodMonitor selects on.
    for role in (naming.ROLE_WORKER, naming.ROLE_SPARE):
        assert naming.LABEL_JOB_NAME in naming.pod_labels("train", role, 0)
    # The operator watches every namespace: so does the PodMonitor.
    assert spec["namespaceSelector"] == {"any": True}
    assert spec["podTargetLabels"] == [naming.LABEL_JOB_NAME]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint == {"port": AGENT_METRICS_PORT_NAME, "path": "/metrics", "interval": "30s",
                        "scrapeTimeout": "10s"}


def test_agents_pod_monitor_watches_the_operators_namespaces(render: Render) -> None:
    values = {"metrics": {"enabled": True, "agents": {"podMonitor": {"interval": "1m", "scrapeTimeout": "20s"}}},
              "operator": {"watchNamespaces": ["team-a", "team-b"]}}
    spec = agent_monitor(render(values, MONITORING))["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("1m", "20s")


@pytest.mark.parametrize(("values", "api_versions"), [
    ({"metrics": {"enabled": True, "agents": {"podMonitor": {"enabled": False}}}}, MONITORING),
    ({"metrics": {"enabled": True, "agents": {"enabled": False}}}, MONITORING),
    ({"metrics": {"enabled": False, "agents": {"enabled": True, "podMonitor": {"enabled": True}}}}, MONITORING),
    (AGENTS, None),
], ids=["podMonitor-off", "agents-off", "metrics-off", "no-monitoring-api"])
def test_no_agents_pod_monitor_unless_everything_asks_for_it(render: Render, values: dict[str, Any],
                                                              api_versions: list[str] | None) -> None:
    assert find(render(values, api_versions), "PodMonitor") == []
    # What the case changed is what removed it: with metrics, agents, the PodMonitor and the API it renders.
    assert len(find(render(AGENTS, MONITORING), "PodMonitor")) == 1


@pytest.mark.parametrize(("values", "port"), [
    ({"metrics": {"enabled": True}}, 9400),
    ({"metrics": {"enabled": True, "agents": {"port": 9555}}}, 9555),
    ({"metrics": {"enabled": True, "agents": {"enabled": False}}}, None),
    ({"metrics": {"enabled": False, "agents": {"enabled": True}}}, None),
    ({}, None),
], ids=["default", "own-port", "agents-off", "metrics-off", "defaults"])
def test_operator_gets_the_agent_metrics_port_only_with_metrics_and_agents(render: Render, values: dict[str, Any],
                                                                            port: int | None) -> None:
    args = operator_args(render(values))
    flags = [a for a in args if a.startswith("--agent-metrics-port")]
    assert flags == ([] if port is None else [f"--agent-metrics-port={port}"])
    assert build_parser().parse_args(args).agent_metrics_port == port


def test_slow_recovery_alert_takes_its_bound_from_the_values(render: Render) -> None:
    default = {r["alert"]: r for r in rules(render(ENABLED, MONITORING))}["StalwartSlowRecovery"]
    assert default["expr"].startswith("histogram_quantile(0.9, ")
    assert re.search(r"stalwart_agent_recovery_seconds_bucket\{[^}]*\}\[1h\]\)\)\) > 60$", default["expr"])
    assert f"by (le, namespace, {JOB_NAME_TARGET_LABEL})" in default["expr"]
    assert default["for"] == "5m" and "60 seconds" in default["annotations"]["summary"]
    values = {"metrics": ENABLED["metrics"] | {"prometheusRule": {"enabled": True, "recoverySeconds": 12.5}}}
    custom = {r["alert"]: r for r in rules(render(values, MONITORING))}["StalwartSlowRecovery"]
    assert custom["expr"].endswith("[1h]))) > 12.5")
    assert "12.5 seconds" in custom["annotations"]["summary"]


def test_stale_snapshot_alert_takes_its_bound_from_the_values_and_skips_jobs_without_snapshots(
        render: Render) -> None:
    default = {r["alert"]: r for r in rules(render(ENABLED, MONITORING))}["StalwartPeerSnapshotStale"]
    # The job's complete snapshot is its oldest pod's; a pod that has none (0) is left out, not taken as 1970.
    assert re.fullmatch(rf"time\(\) - min by \(namespace, {JOB_NAME_TARGET_LABEL}\) "
                        r"\(stalwart_agent_peer_snapshot_timestamp_seconds\{[^}]*\} > 0\) > 600", default["expr"])
    assert default["for"] == "5m" and "600 seconds" in default["annotations"]["summary"]
    values = {"metrics": ENABLED["metrics"] | {"prometheusRule": {"enabled": True, "snapshotAgeSeconds": 90}}}
    custom = {r["alert"]: r for r in rules(render(values, MONITORING))}["StalwartPeerSnapshotStale"]
    assert custom["expr"].endswith("> 0) > 90") and "90 seconds" in custom["annotations"]["summary"]


def test_no_agent_alert_without_the_agents_metrics(render: Render) -> None:
    values = {"metrics": ENABLED["metrics"] | {"agents": {"enabled": False}}}
    names = [r["alert"] for r in rules(render(values, MONITORING))]
    assert not set(AGENT_ALERTS) & set(names) and "StalwartOperatorDown" in names
    # Without the PodMonitor the agents still serve: another Prometheus may scrape them, so the alerts stay.
    values = {"metrics": ENABLED["metrics"] | {"agents": {"podMonitor": {"enabled": False}}}}
    assert set(AGENT_ALERTS) <= {r["alert"] for r in rules(render(values, MONITORING))}



def test_lint_is_clean_with_the_agents_pod_monitor() -> None:
    values = {"metrics": {"enabled": True, "prometheusRule": {"enabled": True}},
              "operator": {"watchNamespaces": ["team-a"]}}
    report = helm_python.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE, kube_version="v1.29.0")
    problems_ = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems_ == [], problems_ or report["errors"]
