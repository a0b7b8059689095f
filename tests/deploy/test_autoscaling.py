"""k8s/components/autoscaling-keda and autoscaling-hpa (with k8s/components/saturation).

* Every rendered object is validated: built-in kinds against the Kubernetes schemas
  (``kubernetes-validate``, strict), KEDA's ScaledObjects against KEDA's CRD schema as npm's
  ``@kubernetes-models/keda`` compiles it (scripts/setup.sh installs it under build/npm); CRD
  schemas prune unknown fields instead of refusing them, so every field name is also looked up in
  that schema.
* The recording rules run in ``promtool test rules`` on a scrape recorded from a loaded verifier
  (``scripts/bench_drain.py --scrape``: 8 sessions streaming, the default model on CPU), and must
  give what ``verifier/load.py`` computes from the same samples.
* Each Deployment has exactly one autoscaler, whose query reads a recorded series, and the
  verifier's grace period covers its preStop and drain.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from verifier import load

from . import kustomize, promtool
from .manifests import K8S, ROOT, container, find, of_kind, render, selects, without_generated_suffixes, workload
from .test_monitoring import exported_series, metric_names

COMPONENTS = {"keda": K8S / "components" / "autoscaling-keda", "hpa": K8S / "components" / "autoscaling-hpa"}
RULES = K8S / "components" / "saturation" / "recording-rules.yaml"
ADAPTER = COMPONENTS["hpa"] / "prometheus-adapter-values.yaml"
SCRAPE = Path(__file__).parent / "data" / "verifier-scrape.prom"
KEDA = ROOT / "build" / "npm"
KEDA_SCHEMAS = KEDA / "node_modules" / "@kubernetes-models" / "keda" / "_schemas"
CRD_KINDS = {"ScaledObject", "PrometheusRule", "ServiceMonitor"}
K8S_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
RENDERED = [(scaler, overlay) for scaler in COMPONENTS for overlay in ("cpu", "gpu")]


def build_with(tmp: Path, overlay: str, scaler: str) -> list[dict]:
    rel = {k: os.path.relpath(K8S / p, tmp) for k, p in (("o", f"overlays/{overlay}"), ("m", "components/monitoring"))}
    scaler_rel = os.path.relpath(COMPONENTS[scaler], tmp)
    (tmp / "kustomization.yaml").write_text(
        f"resources:\n  - {rel['o']}\ncomponents:\n  - {rel['m']}\n  - {scaler_rel}\n"
    )
    return kustomize.build(tmp)


@pytest.fixture(scope="module")
def renders(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, list[dict]]]:
    out = {}
    for scaler, overlay in RENDERED:
        d = tmp_path_factory.mktemp(f"{scaler}-{overlay}")
        out[scaler, overlay] = (d, build_with(d, overlay, scaler))
    return out


# --- schemas ----------------------------------------------------------------------------------------


def keda_errors(objs: list[dict]) -> list[str | None]:
    """KEDA's CRD schema's verdict on each ScaledObject (None: valid)."""
    assert shutil.which("node"), "node is missing: run scripts/setup.sh"
    assert KEDA_SCHEMAS.is_dir(), f"{KEDA_SCHEMAS} is missing: run scripts/setup.sh"
    out = subprocess.run(
        ["node", str(Path(__file__).parent / "keda_validate.mjs"), str(KEDA)],
        input=json.dumps(objs),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def keda_field_names() -> set[str]:
    """Every property name the compiled ScaledObject schema knows, with the schemas it imports
    (the HPA behaviour is Kubernetes' own type): names it checks (``data.X``) or reports."""
    names: set[str] = set()
    modules = KEDA / "node_modules"
    todo = [KEDA_SCHEMAS / "ComGithubKedacoreKedaV2ApisKedaV1alpha1ScaledObject.js"]
    seen: set[Path] = set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        text = f.read_text()
        names |= set(re.findall(r'missingProperty:"(\w+)"', text))
        names |= set(re.findall(r"data\w*\.(\w+)", text))
        names |= set(re.findall(r'parentDataProperty:"(\w+)"', text))
        for dep in re.findall(r'from"(\.[^"]*|[^"]*/_schemas/[^"]*)"', text):
            target = (f.parent / dep).resolve() if dep.startswith(".") else modules / dep
            todo.append(target.with_suffix(".js") if target.suffix != ".js" else target)
    return names


def unknown_fields(obj, known: set[str], free=("metadata", "labels", "annotations")) -> list[str]:
    """Keys of ``obj`` the schema does not name (trigger ``metadata`` is a free string map)."""
    out = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key not in known:
                out.append(key)
            if key not in free:
                out += unknown_fields(value, known, free)
    elif isinstance(obj, list):
        for item in obj:
            out += unknown_fields(item, known, free)
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_built_in_object_validates_against_the_kubernetes_schema(renders, version):
    count = 0
    for _, objs in renders.values():
        for obj in objs:
            if obj["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(obj, version, strict=True)
                count += 1
    print(f"{count} objects validated against Kubernetes {version}")
    assert count > 4 * 20


def test_every_scaled_object_validates_against_kedas_crd_schema(renders):
    scaled = [
        o
        for scaler, overlay in RENDERED
        if scaler == "keda"
        for o in of_kind(renders[scaler, overlay][1], "ScaledObject")
    ]
    assert len(scaled) == 4  # verifier and drafter, in two overlays
    assert keda_errors(scaled) == [None] * len(scaled)
    known = keda_field_names()
    assert {"scaleTargetRef", "cooldownPeriod", "horizontalPodAutoscalerConfig", "stabilizationWindowSeconds"} <= known
    # Trigger metadata is a free map; the apiVersion, kind and object metadata are not KEDA's.
    for o in scaled:
        spec_unknown = unknown_fields(o["spec"], known)
        assert not spec_unknown, (o["metadata"]["name"], spec_unknown)
    print(f"{len(scaled)} ScaledObjects validated against KEDA's CRD schema")


def test_the_keda_check_can_fail():
    so = next(yaml.safe_load_all((COMPONENTS["keda"] / "scaledobjects.yaml").read_text()))
    wrong_type = json.loads(json.dumps(so))
    wrong_type["spec"]["minReplicaCount"] = "1"
    no_target = json.loads(json.dumps(so))
    del no_target["spec"]["scaleTargetRef"]
    errors = keda_errors([so, wrong_type, no_target])
    assert errors[0] is None
    assert "minReplicaCount" in errors[1] and "scaleTargetRef" in errors[2]
    typo = json.loads(json.dumps(so))
    typo["spec"]["cooldownPeriodd"] = 300
    assert unknown_fields(typo["spec"], keda_field_names()) == ["cooldownPeriodd"]


# --- one autoscaler per workload, on recorded series ------------------------------------------------


def recorded() -> dict[str, str]:
    rule = yaml.safe_load(RULES.read_text())
    return {r["record"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def test_the_components_are_optional():
    for name in ("base", "cpu", "gpu"):
        objs = render(name)
        assert not of_kind(objs, "ScaledObject", "PrometheusRule")
        assert [h["metadata"]["name"] for h in of_kind(objs, "HorizontalPodAutoscaler")] == [
            "racer-drafter",
            "racer-gateway",
        ]


@pytest.mark.parametrize("scaler,overlay", RENDERED)
def test_each_deployment_has_one_autoscaler_reading_a_recorded_series(renders, scaler, overlay):
    _, objs = renders[scaler, overlay]
    targets: dict[str, list[str]] = {}
    for o in of_kind(objs, "HorizontalPodAutoscaler", "ScaledObject"):
        targets.setdefault(o["spec"]["scaleTargetRef"]["name"], []).append(o["kind"])
    want = "ScaledObject" if scaler == "keda" else "HorizontalPodAutoscaler"
    assert targets == {
        "racer-verifier": [want],
        "racer-drafter": [want],
        "racer-gateway": ["HorizontalPodAutoscaler"],  # gateways keep scaling on CPU
    }
    names = set(recorded())
    if scaler == "keda":
        for o in of_kind(objs, "ScaledObject"):
            (trigger,) = o["spec"]["triggers"]
            assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
            selected = metric_names(trigger["metadata"]["query"])
            assert selected and selected <= names, selected
            assert (
                o["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
                    "stabilizationWindowSeconds"
                ]
                >= 300
            )
    else:
        adapter = {r["name"]["as"]: r for r in yaml.safe_load(ADAPTER.read_text())["rules"]["external"]}
        for service in ("verifier", "drafter"):
            hpa = find(objs, "HorizontalPodAutoscaler", f"racer-{service}")
            (metric,) = hpa["spec"]["metrics"]
            rule = adapter[metric["external"]["metric"]["name"]]
            query = rule["metricsQuery"].replace("<<.LabelMatchers>>", 'namespace="racer"')
            assert metric_names(query) <= names and metric_names(rule["seriesQuery"]) <= names
            assert f"racer:{service}_saturation" in rule["seriesQuery"]
            assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    # The autoscaler owns the verifiers' count: an apply must not reset it.
    assert "replicas" not in workload(objs, "verifier")["spec"]
    for service in ("verifier", "drafter"):  # a node drain takes one pod of each at a time
        pdb = find(objs, "PodDisruptionBudget", f"racer-{service}")
        assert pdb["spec"]["maxUnavailable"] == 1
        assert selects(pdb["spec"]["selector"], workload(objs, service)["spec"]["template"]["metadata"]["labels"])


def test_the_recording_rules_read_exported_metrics():
    exported = exported_series()
    rules = recorded()
    for name, expr in rules.items():
        selected = metric_names(expr)
        assert selected <= exported | set(rules), (name, selected - exported)


@pytest.mark.parametrize("scaler,overlay", RENDERED)
def test_the_verifier_grace_period_covers_its_drain(renders, scaler, overlay):
    """preStop sleep (gateways re-resolve and stop placing sessions there) + RACER_DRAIN_SECONDS
    (streams end after their round in flight) + the process's exit, measured by bench_drain.py."""
    _, objs = renders[scaler, overlay]
    pod = workload(objs, "verifier")["spec"]["template"]["spec"]
    c = container(objs, "verifier")
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    env = {}
    for cm in of_kind(objs, "ConfigMap"):
        if any(cm["metadata"]["name"] == r["configMapRef"]["name"] for r in c.get("envFrom", [])):
            env.update(cm["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    drain = float(env["RACER_DRAIN_SECONDS"])
    assert drain >= 4 * 2.5  # 4x the longest drain measured with 8 sessions streaming (docs/deployment/index.md)
    assert pod["terminationGracePeriodSeconds"] >= sleep + drain + 5


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with built-in kustomize) is not installed")
@pytest.mark.parametrize("scaler,overlay", RENDERED)
def test_the_components_render_the_same_with_kubectl_kustomize(renders, scaler, overlay):
    directory, objs = renders[scaler, overlay]
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

    def keyed(objs):
        res = {}
        for o in without_generated_suffixes(objs):
            o.get("data", {}).pop("api-keys", None)
            res[o["kind"], o["metadata"]["name"]] = o
        return res

    assert keyed(objs) == keyed([o for o in yaml.safe_load_all(out.stdout) if o])


# --- the recording rules, evaluated by promtool ------------------------------------------------------


def scrape_samples() -> dict[str, float]:
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(SCRAPE.read_text())
        for s in fam.samples
        if s.name.startswith("racer_verifier_") and not s.labels
    }


def promtool_case(tmp: Path, expected_verifier: float) -> subprocess.CompletedProcess:
    """Two verifier pods (the recorded one, and one whose KV reservation dominates) and a drafter
    drafting half of each second, evaluated at 2 minutes."""
    s = scrape_samples()
    pods = {
        "racer-verifier-0": {
            k: s[f"racer_verifier_{k}"]
            for k in ("kv_reserved_bytes", "kv_budget_bytes", "model_queue", "admission_waiting")
        },
        "racer-verifier-1": {
            "kv_reserved_bytes": 9e9,
            "kv_budget_bytes": 1e10,
            "model_queue": 1,
            "admission_waiting": 0,
        },
    }
    series = [
        {"series": f'racer_verifier_{k}{{namespace="racer",pod="{pod}"}}', "values": f"{v:g}x10"}
        for pod, values in pods.items()
        for k, v in values.items()
    ]
    series.append(
        {"series": 'racer_draft_latency_seconds_sum{namespace="racer",pod="racer-drafter-0"}', "values": "0+7.5x10"}
    )
    sat = {
        pod: load.saturation(v["kv_reserved_bytes"], v["kv_budget_bytes"], v["model_queue"], v["admission_waiting"])
        for pod, v in pods.items()
    }
    sat["racer-verifier-0"] = expected_verifier
    return promtool.test_rules(
        tmp,
        RULES,
        [
            {
                "interval": "15s",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": "racer:verifier_saturation",
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": f'racer:verifier_saturation{{namespace="racer",pod="{pod}"}}', "value": v}
                            for pod, v in sat.items()
                        ],
                    },
                    {
                        "expr": "racer:verifier_saturation:sum",
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": 'racer:verifier_saturation:sum{namespace="racer"}', "value": sum(sat.values())}
                        ],
                    },
                    {
                        "expr": "racer:drafter_saturation",
                        "eval_time": "2m",
                        "exp_samples": [
                            {
                                "labels": 'racer:drafter_saturation{namespace="racer",pod="racer-drafter-0"}',
                                "value": 0.5 / 0.7,  # half of each second drafting, against 0.7
                            }
                        ],
                    },
                ],
            }
        ],
    )


def test_the_recording_rules_on_a_recorded_scrape_of_a_loaded_verifier(tmp_path):
    s = scrape_samples()
    assert s["racer_verifier_model_queue"] > 0, "the scrape is of a loaded verifier"
    want = load.saturation(
        s["racer_verifier_kv_reserved_bytes"],
        s["racer_verifier_kv_budget_bytes"],
        s["racer_verifier_model_queue"],
        s["racer_verifier_admission_waiting"],
    )
    assert want == pytest.approx(s["racer_verifier_saturation"])  # what the verifier exported itself
    out = promtool_case(tmp_path, want)
    assert out.returncode == 0, out.stdout + out.stderr
    print(f"promtool: racer:verifier_saturation = {want:g} on the recorded scrape\n{out.stdout}")


def test_promtool_fails_on_a_wrong_value(tmp_path):
    out = promtool_case(tmp_path, 0.5)
    assert out.returncode != 0 and "racer:verifier_saturation" in out.stdout + out.stderr
