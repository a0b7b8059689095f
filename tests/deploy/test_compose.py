"""docker-compose.yml: valid under the Compose Specification, and consistent with the services'
settings (common/settings.py) and with the image (Dockerfile)."""

from __future__ import annotations

from urllib.parse import urlsplit

import jsonschema
import pytest
from check_jsonschema.builtin_schemas import get_builtin_schema

from common import settings

from .manifests import (
    COMPOSE_SECRETS,
    MissingVariable,
    allowed_env,
    compose,
    compose_env,
    compose_raw,
    effective,
    image_argv,
    interpolate,
    seconds,
    setting,
)


def _validator():
    # The Compose Specification's JSON schema as vendored (with its Apache-2.0 licence) by the
    # check-jsonschema package, so the test needs no network.
    schema = get_builtin_schema("vendor.compose-spec")
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def racer_services(doc: dict) -> dict[str, str]:
    """Compose service name -> which RACER service it runs (from the argv it ends up with)."""
    out = {}
    for name, svc in doc["services"].items():
        if "build" not in svc:
            continue
        argv = image_argv(svc.get("entrypoint"), svc.get("command"))
        assert argv[:2] == ["racer", "serve"] and argv[2] in settings.PORTS and len(argv) == 3, f"{name}: {argv}"
        out[name] = argv[2]
    return out


def test_compose_file_validates_against_the_compose_spec():
    _validator().validate(compose_raw())
    _validator().validate(compose())  # and once interpolated with the defaults


def test_compose_spec_validation_rejects_mistakes():
    for mistake in (
        lambda d: d["services"]["gateway"].update(healtcheck={}),
        lambda d: d["services"]["gateway"]["depends_on"]["verifier"].update(condition="service_up"),
        lambda d: d["services"]["redis"]["healthcheck"].update(interval=5),  # durations are strings
    ):
        doc = compose()
        mistake(doc)
        with pytest.raises(jsonschema.ValidationError):
            _validator().validate(doc)


def test_interpolation_defaults_and_overrides():
    assert interpolate("${A:-x}") == "x" and interpolate("${A:-x}", {"A": ""}) == "x"
    assert interpolate("${A-x}", {"A": ""}) == "" and interpolate("${A:-x}", {"A": "y"}) == "y"
    assert interpolate("$${A}") == "${A}"
    assert interpolate("${A:?set A}", {"A": "y"}) == "y"
    for text, env in (("${A:?set A}", {}), ("${A:?set A}", {"A": ""}), ("${A?set A}", {})):
        with pytest.raises(MissingVariable, match="set A"):
            interpolate(text, env)


def test_compose_refuses_to_start_without_the_redis_password_and_the_internal_token():
    for missing in COMPOSE_SECRETS:
        env = {k: v for k, v in COMPOSE_SECRETS.items() if k != missing}
        with pytest.raises(MissingVariable, match=missing):
            interpolate(compose_raw(), env)


def test_redis_needs_its_password_and_every_service_the_internal_token():
    doc = compose()
    redis = doc["services"]["redis"]
    command = redis["command"]
    password = COMPOSE_SECRETS["RACER_REDIS_PASSWORD"]
    assert command[command.index("--requirepass") + 1] == password
    assert compose_env(redis)["REDISCLI_AUTH"] == password  # redis-cli ping, the health check, authenticates
    for name, kind in racer_services(doc).items():
        env = compose_env(doc["services"][name])
        assert env["RACER_INTERNAL_TOKEN"] == COMPOSE_SECRETS["RACER_INTERNAL_TOKEN"], name
        variable = {"drafter": "RACER_SNAPSHOT_URL", "gateway": "RACER_SESSION_URL"}.get(kind)
        if variable:
            assert urlsplit(env[variable]).password == password, name


def test_stack_has_redis_a_verifier_two_drafters_and_a_gateway():
    doc = compose()
    kinds = racer_services(doc)
    assert sorted(kinds.values()) == ["drafter", "drafter", "gateway", "verifier"]
    assert "redis" in doc["services"]
    # One image for all of them.
    assert len({doc["services"][name]["image"] for name in kinds}) == 1


def test_healthchecks_ask_the_grpc_health_service():
    doc = compose()
    for name, service in racer_services(doc).items():
        test = doc["services"][name]["healthcheck"]["test"]
        assert test == [
            "CMD",
            "racer",
            "health",
            f"localhost:{settings.PORTS[service][0]}",
            settings.HEALTH_SERVICES[service],
        ]
    # redis-cli exits 0 even when Redis refuses it: the check wants a PONG
    assert doc["services"]["redis"]["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping | grep -q PONG"]


def test_dependencies_wait_for_health():
    doc = compose()
    kinds = racer_services(doc)
    for name, svc in doc["services"].items():
        for dep, spec in svc.get("depends_on", {}).items():
            assert spec["condition"] == "service_healthy", f"{name} -> {dep}"
            assert "healthcheck" in doc["services"][dep], dep
    gateway = next(n for n, k in kinds.items() if k == "gateway")
    assert set(doc["services"][gateway]["depends_on"]) == set(doc["services"]) - {gateway}
    for name, kind in kinds.items():
        if kind == "drafter":
            assert "redis" in doc["services"][name]["depends_on"]


def test_environment_names_and_values_are_ones_the_services_read():
    doc = compose()
    for name, service in racer_services(doc).items():
        env = compose_env(doc["services"][name])
        racer_vars = {k for k in env if k.startswith("RACER_")}
        assert racer_vars <= allowed_env(service), f"{name} does not read {sorted(racer_vars - allowed_env(service))}"
        for var in racer_vars & settings.env_names(service):
            setting(service, var).type(env[var])


def test_gateway_endpoints_name_the_drafter_and_verifier_services():
    doc = compose()
    kinds = racer_services(doc)
    gateway = next(n for n, k in kinds.items() if k == "gateway")
    env = compose_env(doc["services"][gateway])
    for variable, service in (("RACER_DRAFTERS", "drafter"), ("RACER_VERIFIERS", "verifier")):
        endpoints = sorted(env[variable].split(","))
        assert endpoints == sorted(f"{n}:{settings.PORTS[service][0]}" for n, k in kinds.items() if k == service)
    for name, kind in kinds.items():
        variable = {"drafter": "RACER_SNAPSHOT_URL", "gateway": "RACER_SESSION_URL"}.get(kind)
        if variable:
            url = urlsplit(compose_env(doc["services"][name])[variable])
            assert (url.scheme, url.hostname, url.port) == ("redis", "redis", 6379), name


def test_services_that_must_agree_do():
    doc = compose()
    env = {kind: compose_env(doc["services"][name]) for name, kind in racer_services(doc).items()}
    assert effective("drafter", env["drafter"], "RACER_TOPK") == effective("verifier", env["verifier"], "RACER_TOPK")
    assert effective("gateway", env["gateway"], "RACER_MODEL") == effective("verifier", env["verifier"], "RACER_MODEL")


def test_ports_are_the_services_ports_on_loopback():
    """Published ports exist in the container; with no API keys they are reachable from this host only."""
    doc = compose()
    published = []
    for name, service in racer_services(doc).items():
        svc = doc["services"][name]
        grpc_port, metrics_port = settings.PORTS[service]
        targets = set()
        for port in svc.get("ports", []):
            host_ip, host_port, target = port.split(":")
            assert host_ip == "127.0.0.1", f"{name}: {port}"
            targets.add(int(target))
            published.append(int(host_port))
        assert metrics_port in targets, f"{name}: metrics not published"
        assert targets <= {grpc_port, metrics_port}
        if service == "gateway":
            assert grpc_port in targets
            assert compose_env(svc)["RACER_API_KEYS"] == ""
        else:
            assert str(grpc_port) in svc.get("expose", [])
    assert len(published) == len(set(published)), "two services on one host port"


def test_stop_grace_outlasts_the_drain():
    doc = compose()
    for name, service in racer_services(doc).items():
        svc = doc["services"][name]
        drain = effective(service, compose_env(svc), "RACER_DRAIN_SECONDS")
        assert seconds(svc["stop_grace_period"]) > drain, name


def test_redis_persists_to_a_named_volume():
    doc = compose()
    redis = doc["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    data_dir = command[command.index("--dir") + 1]
    volume, mount = redis["volumes"][0].split(":")[:2]
    assert mount == data_dir and volume in doc["volumes"]
