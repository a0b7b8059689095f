"""k8s/: who can reach what (NetworkPolicies, evaluated against the rendered pods), where secrets
come from, and that overlays with mutual TLS have probes that can pass."""

from __future__ import annotations

import copy
import itertools

import pytest

from common import settings

from .manifests import (
    COMPONENT_LABEL,
    OVERLAYS,
    RENDERS,
    SERVICES,
    container_env,
    effective,
    of_kind,
    render,
    secret_value,
    selects,
    service_env,
    workload,
)

NAMESPACE = "racer"
HTTP_PORT = 8000  # the gateway's OpenAI-compatible API (k8s/overlays/cpu-openai)
MONITORING = ("monitoring", {"app.kubernetes.io/name": "prometheus"})  # where Prometheus runs


def _pods(objs):
    """(namespace, labels, container ports) of every workload's pods."""
    out = {}
    for w in of_kind(objs, "Deployment", "StatefulSet"):
        tpl = w["spec"]["template"]
        ports = {p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
        out[w["metadata"]["name"]] = (w["metadata"]["namespace"], tpl["metadata"]["labels"], ports)
    return out


def _peer_matches(peer: dict, policy_ns: str, ns: str, labels: dict) -> bool:
    """NetworkPolicy peer semantics: podSelector alone means the policy's namespace; with a
    namespaceSelector both must match (namespaces carry kubernetes.io/metadata.name)."""
    assert set(peer) <= {"podSelector", "namespaceSelector"}, f"unexpected peer {peer}"
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": ns}):
            return False
    elif ns != policy_ns:
        return False
    return selects(peer.get("podSelector", {}), labels)


def _allowed(policies, src: tuple[str, dict], dst: tuple[str, dict], port: int) -> bool:
    """Whether a pod ``src`` (namespace, labels) may open a TCP connection to pod ``dst`` on ``port``."""
    dst_ns, dst_labels = dst
    selecting = [
        p for p in policies
        if p["metadata"]["namespace"] == dst_ns and selects(p["spec"]["podSelector"], dst_labels)
        and "Ingress" in p["spec"]["policyTypes"]
    ]  # fmt: skip
    if not selecting:
        return True  # not isolated
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(q["port"] == port and q.get("protocol", "TCP") == "TCP" for q in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, p["metadata"]["namespace"], *src) for peer in peers):
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS + ("cpu-openai",))
def test_network_policies_let_only_gateways_reach_backends_and_only_monitoring_reach_metrics(overlay):
    objs = render(overlay)
    policies = of_kind(objs, "NetworkPolicy")
    pods = _pods(objs)
    component = {name: labels.get(COMPONENT_LABEL) for name, (_, labels, _) in pods.items()}
    sources = {name: (ns, labels) for name, (ns, labels, _) in pods.items()}
    sources |= {
        "prometheus": MONITORING,
        "prometheus-elsewhere": ("default", MONITORING[1]),
        "other-pod-in-racer": (NAMESPACE, {"app.kubernetes.io/name": "something-else"}),
        "pod-in-monitoring": ("monitoring", {"app.kubernetes.io/name": "grafana"}),
        "pod-in-default": ("default", {}),
    }
    metrics = {p[1] for p in settings.PORTS.values()}
    grpc = {s: settings.PORTS[s][0] for s in SERVICES}

    def expected(src: str, dst: str, port: int) -> bool:
        if port in metrics:
            return src == "prometheus"
        kind = component[dst]
        if kind == "gateway" and port in (grpc["gateway"], HTTP_PORT):
            return True  # the public APIs: gRPC, and HTTP where an overlay serves it
        if kind in ("drafter", "verifier") and port == grpc[kind]:
            # verifiers also reach each other: the prefix blocks one holds (Verifier.PrefixBlocks)
            return component.get(src) == "gateway" or (kind == "verifier" and component.get(src) == "verifier")
        if kind == "store":
            return component.get(src) in ("drafter", "gateway")
        return False  # anything else (the plaintext health port: only the kubelet, which policies do not filter)

    checked = 0
    for (src, at), (dst, (ns, labels, ports)) in itertools.product(sources.items(), pods.items()):
        for port in ports:
            want = expected(src, dst, port)
            assert _allowed(policies, at, (ns, labels), port) == want, f"{src} -> {dst}:{port}: want {want}"
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("overlay", OVERLAYS + ("cpu-openai",))
def test_every_network_policy_selects_the_pods_it_names(overlay):
    """A label typo would make a policy select nothing (and leave its pods open or closed)."""
    objs = render(overlay)
    pods = _pods(objs)
    for p in of_kind(objs, "NetworkPolicy"):
        selected = [n for n, (ns, labels, _) in pods.items() if selects(p["spec"]["podSelector"], labels)]
        if p["spec"]["podSelector"] == {}:
            assert len(selected) == len(pods)  # the default deny
            continue
        assert len(selected) == 1, f"{p['metadata']['name']} selects {selected}"
        for rule in p["spec"]["ingress"]:
            for peer in rule.get("from", []):
                if "namespaceSelector" not in peer:  # a peer in this namespace: it must exist
                    assert any(selects(peer["podSelector"], labels) for _, labels, _ in pods.values()), peer


def test_the_policy_check_can_fail():
    """Dropping the drafter's policy, or widening its peer, opens drafters to everyone: caught."""
    objs = render("cpu")
    policies = of_kind(objs, "NetworkPolicy")
    drafter = workload(objs, "drafter")["spec"]["template"]["metadata"]["labels"]
    stranger = (NAMESPACE, {"app.kubernetes.io/name": "something-else"})
    port = settings.PORTS["drafter"][0]
    assert not _allowed(policies, stranger, (NAMESPACE, drafter), port)
    wide = copy.deepcopy(policies)
    for p in wide:
        if p["metadata"]["name"] == "racer-drafter":
            p["spec"]["ingress"][0]["from"] = [{"podSelector": {}}]
    assert _allowed(wide, stranger, (NAMESPACE, drafter), port)
    open_ = [p for p in policies if p["metadata"]["name"] not in ("racer-drafter", "racer-default-deny")]
    assert _allowed(open_, stranger, (NAMESPACE, drafter), port)


@pytest.mark.parametrize("name", tuple(RENDERS))
def test_no_pod_mounts_a_service_account_token(name):
    for w in of_kind(render(name), "Deployment", "StatefulSet"):
        assert w["spec"]["template"]["spec"]["automountServiceAccountToken"] is False, w["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_come_from_secrets_and_every_service_shares_the_internal_token(overlay):
    objs = render(overlay)
    token = secret_value("racer-internal", "token")
    for service in SERVICES:
        assert service_env(objs, service)["RACER_INTERNAL_TOKEN"] == token, service
    for cm in of_kind(objs, "ConfigMap"):
        for key, value in cm.get("data", {}).items():
            assert not key.endswith(("_TOKEN", "PASSWORD", "_SECRET")), f"{cm['metadata']['name']}: {key}"
            assert "://" not in value or "@" not in value, f"{cm['metadata']['name']}: {key} has credentials"
            assert not key.endswith("_URL"), f"{key}: store URLs carry the password, they come from a Secret"


def test_an_overlay_runs_mutual_tls_between_the_gateway_and_its_backends_and_between_verifiers():
    objs = render("mtls")
    gw = service_env(objs, "gateway")
    assert gw["RACER_TLS_CA"] and gw["RACER_TLS_CLIENT_CERT"] and gw["RACER_TLS_CLIENT_KEY"]
    assert gw["RACER_TLS_SERVER_NAME"]  # the gateway dials pod IPs
    for service in ("drafter", "verifier"):
        env = service_env(objs, service)
        assert env["RACER_TLS_CERT"] and env["RACER_TLS_KEY"] and env["RACER_TLS_CLIENT_CA"], service
    # Verifiers call each other too (KV transfers), as the gateway calls them: the CA, a certificate
    # their --tls-client-ca accepts (the shared one), and the name it carries (they dial pod IPs).
    v = service_env(objs, "verifier")
    assert v["RACER_TLS_CA"] == v["RACER_TLS_CLIENT_CA"] == gw["RACER_TLS_CA"]
    assert (v["RACER_TLS_CLIENT_CERT"], v["RACER_TLS_CLIENT_KEY"]) == (v["RACER_TLS_CERT"], v["RACER_TLS_KEY"])
    assert v["RACER_TLS_SERVER_NAME"] == gw["RACER_TLS_SERVER_NAME"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tls_on_overlays_have_probes_that_can_pass(overlay):
    """Where a service requires client certificates, the kubelet (which has none) must probe the
    plaintext health port, which the service opens; the TLS files must be in a mounted Secret."""
    objs = render(overlay)
    for service in SERVICES:
        env = service_env(objs, service)
        w = workload(objs, service)["spec"]["template"]["spec"]
        (c,) = w["containers"]
        files = [
            env[k] for k in ("RACER_TLS_CERT", "RACER_TLS_KEY", "RACER_TLS_CLIENT_CA", "RACER_TLS_CA") if env.get(k)
        ]
        files += [env[k] for k in ("RACER_TLS_CLIENT_CERT", "RACER_TLS_CLIENT_KEY") if env.get(k)]
        for path in files:
            (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
            (volume,) = [v for v in w["volumes"] if v["name"] == mount["name"]]
            assert "secret" in volume, f"{service}: {path} is not from a Secret"
            assert path.rsplit("/", 1)[1] in ("tls.crt", "tls.key", "ca.crt")  # a kubernetes.io/tls Secret
        if not env.get("RACER_TLS_CLIENT_CA"):
            continue
        health_port = effective(service, env, "RACER_HEALTH_PORT")
        assert health_port and health_port != settings.PORTS[service][0], service
        assert health_port in {p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == health_port, f"{service} {probe}"
        assert container_env(objs, c)["RACER_HEALTH_PORT"] == str(health_port)


def _redis(objs):
    (sts,) = of_kind(objs, "StatefulSet")
    return sts["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_probe_needs_a_pong_and_tls_where_redis_serves_it(overlay):
    """redis-cli exits 0 even when Redis refuses it, so the probe looks for PONG. Where an overlay
    turns TLS on, Redis has no plaintext port, the probe and the clients trust the CA file of a
    mounted Secret, and the deployment guide gives the rediss:// URL that names that file."""
    objs = render(overlay)
    pod = _redis(objs)
    (c,) = pod["containers"]
    probe = c["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["sh", "-c"] and probe[2].endswith("ping | grep -q PONG")
    args = c["args"]
    if "--tls-port" not in args:
        assert "--tls" not in probe[2]
        return
    assert args[args.index("--port") + 1] == "0", "a plaintext port next to the TLS one"
    files = {args[args.index(f) + 1] for f in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file")}
    ca = args[args.index("--tls-ca-cert-file") + 1]
    assert f"--tls --cacert {ca} ping" in probe[2]
    for path in files:
        (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert "secret" in volume
    readme = (RENDERS["base"].parents[1] / "docs" / "deployment" / "index.md").read_text()
    assert f"rediss://:$PW@redis:{args[args.index('--tls-port') + 1]}/0?ssl_ca_certs={ca}" in readme
    for service in ("drafter", "gateway"):  # the clients of Redis can read that CA file
        w = workload(objs, service)["spec"]["template"]["spec"]
        assert any(ca.startswith(m["mountPath"].rstrip("/") + "/") for m in w["containers"][0]["volumeMounts"])
