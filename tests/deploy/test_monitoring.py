"""k8s/components/monitoring: every PromQL query of the Grafana dashboard and of the alerts names a
metric the services export (read from prometheus_client's registry, not from a list kept here), the
names follow Prometheus conventions, and the component renders beside an overlay (ServiceMonitor,
PrometheusRule, the metrics Service and the dashboard's ConfigMap)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client import REGISTRY

from . import kustomize, promtool
from .manifests import K8S, SERVICES, find, of_kind, render, selects, without_generated_suffixes, workload

COMPONENT = K8S / "components" / "monitoring"
DASHBOARD = COMPONENT / "racer-dashboard.json"
# Grafana's interval variables, replaced by a duration before parsing (PromQL has no variables).
GRAFANA_DURATIONS = re.compile(r"\$__(rate_interval|interval|range)|\$\{__(rate_interval|interval|range)\}")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def racer_families() -> list:
    """The services' metric families as their processes register them."""
    import drafter.metrics  # noqa: F401
    import gateway.metrics  # noqa: F401
    import verifier.metrics  # noqa: F401

    return [m for m in REGISTRY.collect() if m.name.startswith("racer_")]


def exported_series() -> set[str]:
    """Every series name the services expose: a family's name with its type's suffixes."""
    return {m.name + suffix for m in racer_families() for suffix in SUFFIXES[m.type]}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a syntax error raises)."""
    names: set[str] = set()
    tree = promql_parser.parse(GRAFANA_DURATIONS.sub("5m", expr))
    promql_parser.walk(tree, lambda n: names.add(n.name) if isinstance(n, promql_parser.VectorSelector) else None)
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> dict[str, str]:
    """title -> PromQL of every panel target, and of every templating query (label_values' metric)."""
    out = {}
    for panel in dashboard()["panels"]:
        for t in panel.get("targets", []):
            out[f"{panel['title']} [{t['refId']}]"] = t["expr"]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            assert m, f"variable {var['name']}: {query}"
            out[f"${var['name']}"] = m.group(1)
    return out


def rules() -> dict:
    return yaml.safe_load((COMPONENT / "prometheusrule.yaml").read_text())


def rule_queries() -> dict[str, str]:
    return {r["alert"]: r["expr"] for group in rules()["spec"]["groups"] for r in group["rules"]}


# --- every query names an exported metric ------------------------------------------------------------


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_query_names_a_metric_the_services_export(source):
    queries = dashboard_queries() if source == "dashboard" else rule_queries()
    exported = exported_series()
    assert queries
    unknown = {where: sorted(metric_names(q) - exported) for where, q in queries.items()}
    assert not {k: v for k, v in unknown.items() if v}, f"not exported: { {k: v for k, v in unknown.items() if v} }"
    assert all(metric_names(q) for q in queries.values()), "every query selects a metric"


def test_the_check_catches_a_wrong_name_and_a_syntax_error():
    exported = exported_series()
    assert "racer_round_latency_seconds_bucket" in exported and "racer_failovers_total" in exported
    assert metric_names("rate(racer_failovers[5m])") - exported == {"racer_failovers"}  # a counter without _total
    assert metric_names("racer_round_latency_ms_bucket") - exported == {"racer_round_latency_ms_bucket"}
    with pytest.raises(ValueError):
        metric_names("sum(rate(racer_failovers_total[5m])")


def test_the_dashboard_has_the_panels_operators_need():
    used = set().union(*map(metric_names, dashboard_queries().values()))
    for metric in (
        "racer_generation_tokens_total",  # tokens/s (per tenant)
        "racer_spec_decode_num_accepted_tokens_total",  # acceptance rate and MAT
        "racer_spec_decode_num_draft_tokens_total",
        "racer_spec_decode_num_drafts_total",
        "racer_spec_decode_num_accepted_tokens_per_pos_total",
        "racer_time_to_first_token_seconds_bucket",
        "racer_time_per_output_token_seconds_bucket",  # inter-token latency
        "racer_verify_batch_size_bucket",
        "racer_verifier_kv_reserved_bytes",  # KV usage
        "racer_verifier_kv_budget_bytes",
        "racer_failovers_total",
        "racer_snapshot_failures_total",
    ):
        assert metric in used, metric
    tenant_panels = [q for q in dashboard_queries().values() if 'tenant=~"$tenant"' in q]
    assert tenant_panels, "a panel filters by the tenant variable"
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def test_the_alerts_the_operators_need():
    assert set(rule_queries()) == {
        "RacerNoHealthyVerifier",
        "RacerFailoverRate",
        "RacerStoreFailures",
        "RacerKVCacheNearFull",
    }
    for group in rules()["spec"]["groups"]:
        for r in group["rules"]:
            assert r["labels"]["severity"] in {"critical", "warning"} and r["annotations"]["summary"]
            assert re.fullmatch(r"\d+[smh]", r["for"])


# --- the alerts, evaluated by promtool -----------------------------------------------------------------

NS = 'namespace="racer"'


def _series(name: str, labels: str, values: str) -> dict:
    return {"series": f"{name}{{{NS},{labels}}}", "values": values}


def _alert(name: str, at: str, fired: list[dict]) -> dict:
    return {"alertname": name, "eval_time": at, "exp_alerts": fired}


def _firing(alert: str, summary: str, **labels) -> dict:
    """The alert as promtool must see it: its severity and labels, its summary as rendered."""
    rule = next(r for g in rules()["spec"]["groups"] for r in g["rules"] if r["alert"] == alert)
    return {
        "exp_labels": {"severity": rule["labels"]["severity"], **labels},
        "exp_annotations": {"summary": summary, "description": rule["annotations"]["description"]},
    }


STORE_SUMMARY = "Session store or snapshot calls are failing"
KV_FULL = _firing("RacerKVCacheNearFull", "Verifier v-0 holds 95% of its KV budget", namespace="racer", pod="v-0")
# Each alert against series that must fire it (after its `for`, not before) and series that must
# not. Counters grow per 1-minute sample; a labelled counter has no series until its first
# increment, as prometheus_client exports it.
ALERT_CASES = {
    "RacerNoHealthyVerifier": [
        {  # two gateways, neither sees a verifier: fires once it lasted 1m
            "input_series": [
                _series("racer_gateway_healthy_endpoints", 'kind="verifier",pod="gw-0"', "0x10"),
                _series("racer_gateway_healthy_endpoints", 'kind="verifier",pod="gw-1"', "0x10"),
                _series("racer_gateway_healthy_endpoints", 'kind="drafter",pod="gw-0"', "2x10"),
            ],
            "alerts": [
                _alert("RacerNoHealthyVerifier", "30s", []),
                _alert(
                    "RacerNoHealthyVerifier",
                    "3m",
                    [_firing("RacerNoHealthyVerifier", "No gateway sees a healthy verifier")],
                ),
            ],
        },
        {  # one gateway still routes to a verifier
            "input_series": [
                _series("racer_gateway_healthy_endpoints", 'kind="verifier",pod="gw-0"', "0x10"),
                _series("racer_gateway_healthy_endpoints", 'kind="verifier",pod="gw-1"', "1x10"),
            ],
            "alerts": [_alert("RacerNoHealthyVerifier", "5m", [])],
        },
    ],
    "RacerFailoverRate": [
        {  # 10 turns a minute, one failover a minute: 10% of turns
            "input_series": [
                _series("racer_requests_total", 'code="OK",pod="gw-0"', "0+10x40"),
                _series("racer_failovers_total", 'kind="verifier",pod="gw-0"', "0+1x40"),
            ],
            "alerts": [
                _alert("RacerFailoverRate", "5m", []),
                _alert("RacerFailoverRate", "30m", [_firing("RacerFailoverRate", "10% of turns fail over")]),
            ],
        },
        {  # one failover in 50 turns: 2%, under the 5% bound
            "input_series": [
                _series("racer_requests_total", 'code="OK",pod="gw-0"', "0+50x40"),
                _series("racer_failovers_total", 'kind="drafter",pod="gw-0"', "0+1x40"),
            ],
            "alerts": [_alert("RacerFailoverRate", "30m", [])],
        },
    ],
    "RacerStoreFailures": [
        {  # the gateways' store calls fail; no drafter ever failed a snapshot
            "input_series": [_series("racer_store_failures_total", 'op="save",pod="gw-0"', "0+3x20")],
            "alerts": [
                _alert("RacerStoreFailures", "2m", []),
                _alert("RacerStoreFailures", "12m", [_firing("RacerStoreFailures", STORE_SUMMARY)]),
            ],
        },
        {  # the drafters' snapshots fail; no gateway ever failed a store call
            "input_series": [_series("racer_snapshot_failures_total", 'op="save",pod="drafter-0"', "0+3x20")],
            "alerts": [_alert("RacerStoreFailures", "12m", [_firing("RacerStoreFailures", STORE_SUMMARY)])],
        },
        {  # failures long ago, none in the last 5 minutes
            "input_series": [
                _series("racer_store_failures_total", 'op="save",pod="gw-0"', "0 5 5x30"),
                _series("racer_snapshot_failures_total", 'op="save",pod="drafter-0"', "0 0 0x30"),
            ],
            "alerts": [_alert("RacerStoreFailures", "25m", [])],
        },
    ],
    "RacerKVCacheNearFull": [
        {  # one verifier at 95% of its KV budget for 20 minutes, another at 50%
            "input_series": [
                _series("racer_verifier_kv_reserved_bytes", 'pod="v-0"', "950x25"),
                _series("racer_verifier_kv_budget_bytes", 'pod="v-0"', "1000x25"),
                _series("racer_verifier_kv_reserved_bytes", 'pod="v-1"', "500x25"),
                _series("racer_verifier_kv_budget_bytes", 'pod="v-1"', "1000x25"),
            ],
            "alerts": [
                _alert("RacerKVCacheNearFull", "10m", []),
                _alert("RacerKVCacheNearFull", "20m", [KV_FULL]),
            ],
        },
        {  # 90% exactly is not past the bound
            "input_series": [
                _series("racer_verifier_kv_reserved_bytes", 'pod="v-0"', "900x25"),
                _series("racer_verifier_kv_budget_bytes", 'pod="v-0"', "1000x25"),
            ],
            "alerts": [_alert("RacerKVCacheNearFull", "20m", [])],
        },
    ],
}


def _alert_tests(cases: dict) -> list[dict]:
    return [
        {"interval": "1m", "input_series": c["input_series"], "alert_rule_test": c["alerts"]}
        for per_alert in cases.values()
        for c in per_alert
    ]


@pytest.mark.parametrize("alert", sorted(ALERT_CASES))
def test_each_alert_fires_after_its_for_and_not_on_healthy_series(alert, tmp_path):
    assert alert in rule_queries()
    out = promtool.test_rules(tmp_path, COMPONENT / "prometheusrule.yaml", _alert_tests({alert: ALERT_CASES[alert]}))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_reports_an_alert_that_should_have_fired(tmp_path):
    """The cases above could fail: a healthy verifier expected to fire the KV alert is reported."""
    case = ALERT_CASES["RacerKVCacheNearFull"][1]
    wrong = dict(case, alerts=[_alert("RacerKVCacheNearFull", "20m", [KV_FULL])])
    out = promtool.test_rules(tmp_path, COMPONENT / "prometheusrule.yaml", _alert_tests({"x": [wrong]}))
    assert out.returncode != 0 and "RacerKVCacheNearFull" in out.stdout + out.stderr


# --- Prometheus conventions ---------------------------------------------------------------------------


def test_metric_names_follow_prometheus_conventions():
    families = racer_families()
    assert len(families) >= 20
    for m in families:
        assert not re.search(r"_(ms|millis|milliseconds)(_|$)", m.name), f"{m.name}: base units (seconds)"
        if m.type == "histogram":
            assert m.name.endswith(("_seconds", "_bytes", "_size", "_tokens")), f"{m.name}: unit suffix"
        if m.type == "counter":  # prometheus_client exports it as <name>_total
            assert not m.name.endswith("_total")
    latencies = [m for m in families if "latency" in m.name or "token_seconds" in m.name]
    assert latencies and all(m.name.endswith("_seconds") for m in latencies)


def test_latency_buckets_cover_the_measured_ranges():
    from common.metrics import FAST_SECONDS_BUCKETS, MODEL_SECONDS_BUCKETS, REQUEST_SECONDS_BUCKETS

    # docs/benchmarks/results.md: a drafter step 0.1-0.6 ms; a verification 2-10 ms (GPU) to 30-200 ms (two
    # CPU cores); a first token up to seconds. Each range spans several buckets.
    def inside(buckets, lo, hi):
        return sum(lo <= b <= hi for b in buckets)

    assert inside(FAST_SECONDS_BUCKETS, 1e-4, 6e-4) >= 3
    assert inside(MODEL_SECONDS_BUCKETS, 2e-3, 0.01) >= 3 and inside(MODEL_SECONDS_BUCKETS, 0.03, 0.2) >= 5
    assert inside(REQUEST_SECONDS_BUCKETS, 0.05, 5) >= 6
    for b in (FAST_SECONDS_BUCKETS, MODEL_SECONDS_BUCKETS, REQUEST_SECONDS_BUCKETS):
        assert list(b) == sorted(set(b))


# --- the k8s component --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def with_monitoring(tmp_path_factory) -> tuple[str, list[dict]]:
    """An overlay that adds the component to the CPU overlay, rendered."""
    d = tmp_path_factory.mktemp("overlay")
    rel = {k: os.path.relpath(K8S / p, d) for k, p in (("cpu", "overlays/cpu"), ("mon", "components/monitoring"))}
    (d / "kustomization.yaml").write_text(f"resources:\n  - {rel['cpu']}\ncomponents:\n  - {rel['mon']}\n")
    return str(d), kustomize.build(d)


def test_the_component_is_optional():
    for name in ("base", "cpu", "gpu"):
        assert not of_kind(render(name), "ServiceMonitor", "PrometheusRule")


def test_the_component_renders_beside_an_overlay(with_monitoring):
    _, objs = with_monitoring
    cpu = render("cpu")
    added = {(o["kind"], o["metadata"]["name"]) for o in without_generated_suffixes(objs)} - {
        (o["kind"], o["metadata"]["name"]) for o in without_generated_suffixes(cpu)
    }
    assert added == {
        ("Service", "racer-metrics"),
        ("ServiceMonitor", "racer"),
        ("PrometheusRule", "racer"),
        ("ConfigMap", "racer-grafana-dashboard-<hash>"),
    }
    assert all(o["metadata"]["namespace"] == "racer" for o in objs if o["kind"] != "Namespace")

    svc = find(objs, "Service", "racer-metrics")
    kubernetes_validate.validate(svc, "1.29", strict=True)
    (port,) = svc["spec"]["ports"]
    for service in SERVICES:  # the Service reaches every RACER pod's named metrics port
        pod = workload(objs, service)["spec"]["template"]
        assert selects({"matchLabels": svc["spec"]["selector"]}, pod["metadata"]["labels"])
        assert any(p["name"] == port["targetPort"] for c in pod["spec"]["containers"] for p in c["ports"])
    redis = find(objs, "StatefulSet", "redis")["spec"]["template"]["metadata"]["labels"]
    assert not selects({"matchLabels": svc["spec"]["selector"]}, redis)

    sm = find(objs, "ServiceMonitor", "racer")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [port["name"]]
    assert find(objs, "PrometheusRule", "racer")["spec"] == rules()["spec"]

    cm = find(objs, "ConfigMap", "racer-grafana-dashboard")
    assert cm["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert json.loads(cm["data"]["racer-dashboard.json"]) == dashboard()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with built-in kustomize) is not installed")
def test_the_component_renders_the_same_with_kubectl_kustomize(with_monitoring):
    directory, objs = with_monitoring
    out = subprocess.run(["kubectl", "kustomize", directory], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

    def keyed(objs):
        out = {}
        for o in without_generated_suffixes(objs):
            o.get("data", {}).pop("api-keys", None)  # a Secret: base64 wrapped differently, compared elsewhere
            out[o["kind"], o["metadata"]["name"]] = o
        return out

    assert keyed(objs) == keyed([o for o in yaml.safe_load_all(out.stdout) if o])
