"""k8s/overlays/cpu-openai: the cpu deployment with the gateway's OpenAI-compatible HTTP API on,
and the API off everywhere else."""

from __future__ import annotations

from common import settings

from .manifests import OVERLAYS, RENDERS, container, effective, find, of_kind, render, selects, service_env, workload


def test_the_http_api_is_off_unless_the_overlay_turns_it_on():
    for name in ("base", *OVERLAYS):
        objs = render(name)
        assert effective("gateway", service_env(objs, "gateway"), "RACER_HTTP_PORT") == 0, name
        assert "http" not in {p["name"] for p in container(objs, "gateway")["ports"]}, name


def test_the_overlay_serves_the_http_port_behind_a_service():
    objs = render("cpu-openai")
    port = effective("gateway", service_env(objs, "gateway"), "RACER_HTTP_PORT")
    assert port > 0
    ports = {p["name"]: p["containerPort"] for p in container(objs, "gateway")["ports"]}
    assert ports == {"grpc": settings.PORTS["gateway"][0], "metrics": settings.PORTS["gateway"][1], "http": port}
    labels = workload(objs, "gateway")["spec"]["template"]["metadata"]["labels"]
    http = find(objs, "Service", "racer-gateway-http")
    assert selects({"matchLabels": http["spec"]["selector"]}, labels)
    assert [(p["targetPort"], p["port"]) for p in http["spec"]["ports"]] == [("http", port)]
    # nothing else changes: the same objects as the cpu overlay, but the HTTP Service and the policy
    # that lets clients reach its port
    cpu = {(o["kind"], o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] == "ConfigMap" else o["metadata"]["name"])
           for o in render("cpu")}  # fmt: skip
    mine = {(o["kind"], o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] == "ConfigMap" else o["metadata"]["name"])
            for o in objs}  # fmt: skip
    assert mine - cpu == {("Service", "racer-gateway-http"), ("NetworkPolicy", "racer-gateway-http")}
    assert len(of_kind(objs, "Service")) == len(of_kind(render("cpu"), "Service")) + 1
    assert RENDERS["cpu-openai"].is_dir()
