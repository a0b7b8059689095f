"""k8s/: every rendered object is valid Kubernetes, and the manifests agree with what the services
read and serve (common/settings.py) and with each other (Services, HPAs, PDBs, the GPU overlay)."""

from __future__ import annotations

import base64
import math
import re
import shutil
import subprocess
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from common import settings

from . import kustomize
from .manifests import (
    COMPONENT_LABEL,
    OVERLAYS,
    RENDERS,
    SERVICES,
    allowed_env,
    container,
    container_env,
    cpu_quantity,
    dockerfile,
    dockerfile_env,
    effective,
    final_stage,
    find,
    of_kind,
    render,
    secret_value,
    selects,
    service_env,
    setting,
    without_generated_suffixes,
    workload,
)

ALL_RENDERS = tuple(RENDERS)  # base, cpu, gpu, mtls
# The oldest Kubernetes these manifests target (native gRPC probes are GA since 1.27, HPA v2 and
# PDB policy/v1 long before) and the newest the schema package knows.
K8S_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())


# --- schemas and rendering --------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ALL_RENDERS)
def test_every_object_validates_against_the_kubernetes_schema(name, version):
    objs = render(name)
    assert objs
    for obj in objs:
        # strict: unknown fields (a typo such as `readinesProbe`) are errors, not silently dropped.
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_rejects_mistakes():
    """The check above can fail: a misspelt field, a string port and a named gRPC probe port."""
    deployment = find(render("cpu"), "Deployment", "racer-drafter")
    mistakes = [
        lambda c: c.update(readinesProbe=c.pop("readinessProbe")),
        lambda c: c["ports"][0].update(containerPort="50061"),
        lambda c: c["readinessProbe"]["grpc"].update(port="grpc"),  # gRPC probes take a number only
    ]
    for make_mistake in mistakes:
        broken = yaml.safe_load(yaml.safe_dump(deployment))
        make_mistake(broken["spec"]["template"]["spec"]["containers"][0])
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with built-in kustomize) is not installed")
@pytest.mark.parametrize("name", ALL_RENDERS)
def test_python_renderer_matches_kubectl_kustomize(name):
    out = subprocess.run(["kubectl", "kustomize", str(RENDERS[name])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = [o for o in yaml.safe_load_all(out.stdout) if o]

    def keyed(objs):
        out = {}
        for o in without_generated_suffixes(objs):
            if o["kind"] == "Secret":  # kustomize wraps base64 at 70 columns; compare the bytes
                o["data"] = {k: base64.b64decode(v) for k, v in o.get("data", {}).items()}
            out[o["kind"], o["metadata"]["name"]] = o
        return out

    assert keyed(render(name)) == keyed(theirs)


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nimages:\n  - name: racer\n    newTag: x\n")
    with pytest.raises(kustomize.Unsupported):
        kustomize.build(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("configMapGenerator:\n  - name: c\n    envs: [c.env]\n")
    (tmp_path / "c.env").write_text("FROM_THE_ENVIRONMENT\n")
    with pytest.raises(kustomize.Unsupported):
        kustomize.build(tmp_path)


def test_generated_names_follow_their_content():
    """A changed setting renames its ConfigMap, and so the pods that use it roll."""

    def name(objs, config_map):
        return find(objs, "ConfigMap", config_map)["metadata"]["name"]

    base = render("base")
    for overlay in ("cpu", "gpu"):
        objs = render(overlay)
        assert name(objs, "racer-verifier") != name(base, "racer-verifier")  # the overlay changes it
        assert name(objs, "racer-drafter") == name(base, "racer-drafter")
        refs = [s["configMapRef"]["name"] for s in container(objs, "verifier")["envFrom"]]
        assert name(objs, "racer-verifier") in refs


def test_strategic_merge_follows_kubernetes_merge_keys():
    base = {
        "spec": {
            "containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]}, {"name": "b"}],
            "tolerations": [{"key": "k1"}],
            "nodeSelector": {"n": "1"},
        }
    }
    patch = {
        "spec": {
            "containers": [{"name": "a", "env": [{"name": "B", "value": "2"}]}],
            "tolerations": [{"key": "k2"}],
            "nodeSelector": None,
        }
    }
    merged = kustomize.strategic_merge(base, patch)
    assert merged["spec"]["containers"] == [
        {"name": "a", "image": "x", "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}]},
        {"name": "b"},
    ]
    assert merged["spec"]["tolerations"] == [{"key": "k2"}]  # no merge key: replaced
    assert "nodeSelector" not in merged["spec"]  # null deletes
    assert base["spec"]["nodeSelector"] == {"n": "1"}  # inputs untouched


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_everything_lives_in_one_namespace(name):
    objs = render(name)
    (namespace,) = of_kind(objs, "Namespace")
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == namespace["metadata"]["name"], obj["metadata"]["name"]


# --- the services' contract (common/settings.py) ------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", SERVICES)
def test_command_ports_probes_and_scrape_annotations_match_settings(overlay, service):
    objs = render(overlay)
    pod = workload(objs, service)["spec"]["template"]
    c = container(objs, service)
    grpc_port, metrics_port = settings.PORTS[service]

    assert c.get("command", []) + c.get("args", []) == ["racer", "serve", service]
    env = service_env(objs, service)
    health_port = effective(service, env, "RACER_HEALTH_PORT")
    ports = {"grpc": grpc_port, "metrics": metrics_port} | ({"health": health_port} if health_port else {})
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports

    # Probes carry no client certificate: behind mutual TLS they ask the plaintext health port.
    probe_port = health_port if env.get("RACER_TLS_CLIENT_CA") else grpc_port
    health = settings.HEALTH_SERVICES[service]
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": probe_port, "service": health}, probe
    # Liveness asks whether the server answers at all ("" is the server-wide health entry).
    assert c["livenessProbe"]["grpc"]["port"] == probe_port
    assert c["livenessProbe"]["grpc"].get("service", "") in ("", health)

    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", SERVICES)
def test_environment_names_and_values_are_ones_the_service_reads(overlay, service):
    objs = render(overlay)
    env = service_env(objs, service)
    racer_vars = {k for k in env if k.startswith("RACER_")}
    assert racer_vars <= allowed_env(service), f"{service} does not read {sorted(racer_vars - allowed_env(service))}"
    for name in racer_vars & settings.env_names(service):
        setting(service, name).type(env[name])  # parses as the service will parse it
    for name, port in (("RACER_PORT", 0), ("RACER_METRICS_PORT", 1)):
        if name in env:
            assert int(env[name]) == settings.PORTS[service][port]
    # No Service-link variables (<SERVICE>_PORT=tcp://...) that could shadow a RACER_ setting.
    assert workload(objs, service)["spec"]["template"]["spec"]["enableServiceLinks"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_that_must_agree_do(overlay):
    objs = render(overlay)
    env = {s: service_env(objs, s) for s in SERVICES}
    # The drafter's copy-logit rows are as wide as the verifier's top-k.
    assert effective("drafter", env["drafter"], "RACER_TOPK") == effective("verifier", env["verifier"], "RACER_TOPK")
    # The gateway tokenizes with the verifier's model.
    assert effective("gateway", env["gateway"], "RACER_MODEL") == effective("verifier", env["verifier"], "RACER_MODEL")


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", SERVICES)
def test_termination_grace_outlasts_prestop_and_drain(overlay, service):
    objs = render(overlay)
    pod = workload(objs, service)["spec"]["template"]["spec"]
    c = container(objs, service)
    drain = effective(service, service_env(objs, service), "RACER_DRAIN_SECONDS")
    pre_stop = _pre_stop_sleep(c)
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_drafters_and_verifiers_keep_serving_until_gateways_re_resolve(overlay):
    objs = render(overlay)
    resolve_every = effective("gateway", service_env(objs, "gateway"), "RACER_RESOLVE_EVERY")
    for service in ("drafter", "verifier"):
        assert _pre_stop_sleep(container(objs, service)) >= resolve_every, service


def _pre_stop_sleep(c: dict) -> float:
    pre_stop = c.get("lifecycle", {}).get("preStop")
    if not pre_stop:
        return 0.0
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


# --- discovery: Services, DNS names, Redis -----------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_drafters_and_verifiers_are_behind_headless_services(overlay):
    """The gateway hashes over drafter pods and sticks to verifier pods, so it must resolve pods."""
    objs = render(overlay)
    for service in ("drafter", "verifier"):
        svc = _service_for(objs, service)
        assert svc["spec"]["clusterIP"] == "None"
        assert not svc["spec"].get("publishNotReadyAddresses", False)  # only ready pods are resolved
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": settings.PORTS[service][0]}
    gateway = _service_for(objs, "gateway")
    assert {p["port"] for p in gateway["spec"]["ports"]} == {settings.PORTS["gateway"][0]}


def _service_for(objs, service):
    labels = workload(objs, service)["spec"]["template"]["metadata"]["labels"]
    hits = [s for s in of_kind(objs, "Service") if selects({"matchLabels": s["spec"]["selector"]}, labels)]
    assert len(hits) == 1, f"{service}: {len(hits)} Services"
    return hits[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_endpoints_resolve_to_the_headless_services(overlay):
    objs = render(overlay)
    env = service_env(objs, "gateway")
    for variable, service in (("RACER_DRAFTERS", "drafter"), ("RACER_VERIFIERS", "verifier")):
        m = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", env[variable])
        assert m, f"{variable}={env[variable]!r} is not dns:///<service>.<namespace>.svc.cluster.local:<port>"
        name, namespace, port = m.group(1), m.group(2), int(m.group(3))
        svc = find(objs, "Service", name)
        assert svc is _service_for(objs, service)
        assert svc["metadata"]["namespace"] == namespace
        assert port == settings.PORTS[service][0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_urls_point_at_the_redis_service(overlay):
    """The URLs carry the password, so they come from the racer-redis Secret (never a ConfigMap);
    the URL the deployment guide's command puts there names the Redis Service, and Redis requires the
    password of the same Secret."""
    objs = render(overlay)
    readme = (RENDERS["base"].parents[1] / "docs" / "deployment" / "index.md").read_text()
    (documented,) = set(re.findall(r"url=(redis://:\$\w+@[\w.-]+:\d+/\d+)", readme))
    for service, variable in (("drafter", "RACER_SNAPSHOT_URL"), ("gateway", "RACER_SESSION_URL")):
        assert service_env(objs, service)[variable] == secret_value("racer-redis", "url"), variable
        url = urlsplit(documented)
        assert url.scheme == "redis" and url.password
        host = url.hostname.split(".")
        svc = find(objs, "Service", host[0])
        assert host[1:] in (
            [],
            [svc["metadata"]["namespace"]],
            [svc["metadata"]["namespace"], "svc", "cluster", "local"],
        )
        assert url.port in {p["port"] for p in svc["spec"]["ports"]}
        selector = {"matchLabels": svc["spec"]["selector"]}
        (redis,) = [
            s for s in of_kind(objs, "StatefulSet") if selects(selector, s["spec"]["template"]["metadata"]["labels"])
        ]
        assert redis["spec"]["serviceName"] == svc["metadata"]["name"]
        (c,) = redis["spec"]["template"]["spec"]["containers"]
        args = c["args"]
        assert args[args.index("--appendonly") + 1] == "yes"  # sessions survive a Redis restart
        assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
        env = container_env(objs, c)
        assert env["REDIS_PASSWORD"] == env["REDISCLI_AUTH"] == secret_value("racer-redis", "password")
        assert redis["spec"]["volumeClaimTemplates"], "Redis data on a persistent volume"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_keys_file_is_mounted_from_the_secret(overlay):
    """From the racer-api-keys Secret, which the repository does not hold: the deployment guide's command
    makes it, with the key name the gateway reads. The mount is the whole volume (no subPath), so
    an updated Secret reaches the file and the gateway reads it again."""
    objs = render(overlay)
    assert not of_kind(objs, "Secret"), "a key, token or password in the repository"
    c = container(objs, "gateway")
    path = service_env(objs, "gateway")["RACER_API_KEYS"]
    assert path, "the cluster gateway must not run without tenant keys"
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True and "subPath" not in mount
    pod = workload(objs, "gateway")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "racer-api-keys"
    key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    readme = (RENDERS["base"].parents[1] / "docs" / "deployment" / "index.md").read_text()
    assert f"create secret generic racer-api-keys --from-file={key}=" in readme
    assert effective("gateway", service_env(objs, "gateway"), "RACER_API_KEYS_RELOAD_SECONDS") > 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_does_not_start_without_a_tenant_key(overlay, tmp_path):
    """A gateway whose key file holds no key refuses every call, so an init container keeps the
    pod from starting (and from passing its probes) until the Secret has one. Its check must agree with the
    gateway's own parser on every kind of file, and must refuse the file shipped in k8s/base."""
    from gateway.auth import load_api_keys

    objs = render(overlay)
    pod = workload(objs, "gateway")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == container(objs, "gateway")["image"]
    path = service_env(objs, "gateway")["RACER_API_KEYS"]
    assert container_env(objs, init)["RACER_API_KEYS"] == path
    mount = next(m for m in container(objs, "gateway")["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount in init["volumeMounts"]

    shipped = (RENDERS["base"].parent / "api-keys.example").read_text()
    samples = {
        "shipped": shipped,
        "empty": "",
        "blank and comments": "\n   \n# a comment\n\t# another\n",
        "one key": "k3y-1 tenant-a\n",
        "key after comments": "# keys\n\n  k3y-2 tenant-b  # team b\n",
        "no final newline": "k3y-3 tenant-c",
    }
    for label, text in samples.items():
        keys_file = tmp_path / "api-keys"
        keys_file.write_text(text)
        env = {"PATH": "/usr/bin:/bin", "RACER_API_KEYS": str(keys_file)}
        run = subprocess.run(init["command"], env=env, capture_output=True, text=True, timeout=10)
        keys = load_api_keys(str(keys_file))
        assert (run.returncode == 0) == bool(keys), label
        if label == "shipped":
            assert not keys and run.returncode != 0 and "racer-api-keys" in run.stderr


# --- scaling and disruption --------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpas_scale_drafters_and_gateways_on_cpu(overlay):
    objs = render(overlay)
    hpas = of_kind(objs, "HorizontalPodAutoscaler")
    targets = {}
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
        deployment = find(objs, "Deployment", ref["name"])
        service = deployment["spec"]["template"]["metadata"]["labels"][COMPONENT_LABEL]
        targets[service] = deployment
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        (metric,) = hpa["spec"]["metrics"]
        assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
        # Utilization is measured against requests: without a CPU request the HPA cannot act.
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            assert "cpu" in c["resources"]["requests"]
        # The HPA owns the replica count; a replicas field would reset it on every apply.
        assert "replicas" not in deployment["spec"]
    assert set(targets) == {"drafter", "gateway"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_workload_has_a_pdb_that_selects_only_its_pods(overlay):
    objs = render(overlay)
    workloads = of_kind(objs, "Deployment", "StatefulSet")
    covered = set()
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        matched = [
            w for w in workloads if selects(pdb["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(matched) == 1, f"{pdb['metadata']['name']} selects {len(matched)} workloads"
        (w,) = matched
        covered.add(w["metadata"]["name"])
        # A drain must be able to proceed even with a single replica.
        assert pdb["spec"].get("maxUnavailable", 0) >= 1 or pdb["spec"]["minAvailable"] < w["spec"].get("replicas", 1)
    assert {workload(objs, s)["metadata"]["name"] for s in SERVICES} <= covered


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_threads_and_security(overlay):
    objs = render(overlay)
    (user,) = [i.value[0] for i in dockerfile() if i.cmd == "USER" and i.stage == final_stage()]
    home = dockerfile_env(final_stage())["HOME"]
    for w in of_kind(objs, "Deployment", "StatefulSet"):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod.get("initContainers", []) + pod["containers"]:
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{c['name']} {kind}"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            env = container_env(objs, c)
            if "OMP_NUM_THREADS" in env:  # more threads than cores makes every op several times slower
                assert int(env["OMP_NUM_THREADS"]) <= max(
                    1, math.ceil(cpu_quantity(c["resources"]["limits"]["cpu"]))
                ), c["name"]
            if c.get("command", [None])[0] == "racer":
                # The image's user, and writable /tmp and $HOME over the read-only image.
                assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == user
                assert c["securityContext"]["readOnlyRootFilesystem"] is True
                writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
                assert {"/tmp", home} <= writable, c["name"]


# --- the overlays --------------------------------------------------------------------------------------


def test_cpu_verifier_is_a_guaranteed_pod_on_whole_cpus():
    """The CPU overlay's verifier can have cores of its own (kubelet static CPU manager policy):
    every container's requests equal its limits, and its CPUs are whole."""
    pod = workload(render("cpu"), "verifier")["spec"]["template"]["spec"]
    for c in pod.get("initContainers", []) + pod["containers"]:
        res = c["resources"]
        assert res["requests"] == res["limits"], c["name"]
        cpu = cpu_quantity(res["limits"]["cpu"])
        assert cpu >= 1 and cpu == int(cpu), c["name"]


def test_gpu_overlay_changes_only_the_verifier():
    cpu, gpu = render("cpu"), render("gpu")

    def keyed(objs):
        return {(o["kind"], o["metadata"]["name"]): o for o in without_generated_suffixes(objs)}

    cpu_k, gpu_k = keyed(cpu), keyed(gpu)
    assert cpu_k.keys() == gpu_k.keys()
    changed = {key for key in cpu_k if cpu_k[key] != gpu_k[key]}
    assert changed == {("Deployment", "racer-verifier"), ("ConfigMap", "racer-verifier-<hash>")}

    pod = workload(gpu, "verifier")["spec"]["template"]["spec"]
    c = container(gpu, "verifier")
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert pod["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in pod["tolerations"])
    assert service_env(gpu, "verifier")["RACER_DEVICE"] == "cuda"
    assert c["image"].endswith("-cuda")


@pytest.mark.parametrize("name", ("base", "cpu"))
def test_no_gpu_outside_the_gpu_overlay(name):
    objs = render(name)
    for w in of_kind(objs, "Deployment", "StatefulSet"):
        pod = w["spec"]["template"]["spec"]
        assert "nodeSelector" not in pod and "tolerations" not in pod
        for c in pod["containers"]:
            assert not any("nvidia.com" in r for kind in c["resources"].values() for r in kind)
            assert not c["image"].endswith("-cuda")
    if name == "cpu":
        assert service_env(objs, "verifier")["RACER_DEVICE"] == "cpu"
