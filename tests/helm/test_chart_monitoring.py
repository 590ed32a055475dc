"""The chart's Grafana dashboard and PrometheusRule: rendered only when asked for (the rule only where its API
exists), and every query built on the metrics the operator serves (stalwart/operator/metrics.py): no metric name
and no label that the operator does not expose."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python
import kubernetes_validate
import pytest
from helm_render import CHART_DIR, NAMESPACE, Render, find, one
from prometheus_client.metrics import MetricWrapperBase

from stalwart.operator import metrics

MONITORING = ["monitoring.coreos.com/v1"]
DASHBOARD = CHART_DIR / "dashboards" / "stalwart.json"
ENABLED: dict[str, Any] = {"metrics": {"enabled": True, "dashboard": {"enabled": True},
                                       "prometheusRule": {"enabled": True}}}
# Labels every series the chart's ServiceMonitor scrapes carries besides its own (the Prometheus Operator sets job
# to the Service's name and namespace to the target's). The alerts use them to select this release's operator; the
# dashboard, which has no variable for them, does not.
TARGET_LABELS = frozenset({"job", "namespace"})
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exposed_series() -> dict[str, frozenset[str]]:
    """Each series name the operator exposes -> its labels, from the collectors of stalwart.operator.metrics.

    prometheus_client keeps a Counter's name without ``_total`` and exposes ``<name>_total``; a Histogram
    ``<name>`` exposes ``<name>_bucket`` (with ``le``), ``<name>_sum`` and ``<name>_count`` (``_created``
    series, exposed too, are no use in a query and left out). The label names have no public accessor."""
    series: dict[str, frozenset[str]] = {}
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        (family,) = collector.describe()
        labels = frozenset(collector._labelnames)
        for suffix in SUFFIXES[family.type]:
            series[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return series


SERIES = exposed_series()
STALWART = re.compile(r"\bstalwart_[a-z_]+")
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
    alerts = rules(render(ENABLED, MONITORING))
    assert [r["alert"] for r in alerts] == ["StalwartJobFailed", "StalwartJobRestartingTooLong",
                                            "StalwartHighRestartRate", "StalwartOperatorAPIErrors",
                                            "StalwartOperatorEtcdErrors", "StalwartOperatorDown"]
    service = one(render(ENABLED, MONITORING), "Service", "-operator-metrics")["metadata"]["name"]
    target = f'job="{service}", namespace="{NAMESPACE}"'
    for alert in alerts:
        expr = alert["expr"]
        if alert["alert"] == "StalwartOperatorDown":
            # The scrape's own series, of the Service the ServiceMonitor scrapes (its job label).
            assert expr == f"up{{{target}}} == 0"
            continue
        assert problems(expr, TARGET_LABELS) == [], alert["alert"]
        # Every series of the alert is this release's operator's.
        for name, matchers in SELECTOR.findall(expr):
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
])
def test_schema_refuses_bad_monitoring_values(chart: helm_python.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.validate_schema(values)
    assert message in str(err.value)


def test_lint_is_clean_with_dashboard_and_rule() -> None:
    report = helm_python.lint(CHART_DIR, ENABLED, strict=True, namespace=NAMESPACE, kube_version="v1.29.0")
    problems_ = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems_ == [], problems_ or report["errors"]
