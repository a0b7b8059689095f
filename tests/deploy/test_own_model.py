"""Serving a GGUF file of one's own from a volume: docker-compose.gguf.yml (an override of
docker-compose.yml) and k8s/overlays/own-model. The verifier serves the file and the gateway
tokenizes with it (racer/launch.py: both read ``--model``), so both mount it and name the same
path; each converts it once into RACER_CACHE, which must be writable; the drafters get no prior
(the shipped one is the bundled model's)."""

from __future__ import annotations

import posixpath

import jsonschema
import pytest

from .manifests import (
    MissingVariable,
    allowed_env,
    compose,
    compose_env,
    compose_raw,
    container,
    effective,
    find,
    merge_compose,
    of_kind,
    render,
    service_env,
    setting,
    without_generated_suffixes,
    workload,
)
from .test_compose import _validator, racer_services

OVERRIDE = "docker-compose.gguf.yml"
GGUF_ENV = {"RACER_GGUF_DIR": "/srv/models", "RACER_GGUF_FILE": "x.Q4_K_M.gguf"}


def _under(path: str, directory: str) -> bool:
    return posixpath.commonpath([posixpath.normpath(path), directory.rstrip("/") or "/"]) == directory.rstrip("/")


# --- compose ------------------------------------------------------------------------------------------


def _own() -> dict:
    return compose(OVERRIDE, env=GGUF_ENV)


def test_the_override_validates_against_the_compose_spec():
    _validator().validate(compose_raw(OVERRIDE))
    _validator().validate(_own())


def test_the_override_refuses_to_start_without_the_file():
    for missing in GGUF_ENV:
        with pytest.raises(MissingVariable, match=missing):
            compose(OVERRIDE, env={k: v for k, v in GGUF_ENV.items() if k != missing})


def test_the_merge_is_composes():
    base = {"services": {"a": {"environment": {"X": "1", "Y": "2"}, "volumes": ["v:/data", "w:/w"], "x": [1]}}}
    over = {"services": {"a": {"environment": {"Y": "3"}, "volumes": ["/host:/data:ro"], "x": [2]}}}
    merged = merge_compose(base, over)["services"]["a"]
    assert merged["environment"] == {"X": "1", "Y": "3"}
    assert sorted(merged["volumes"]) == ["/host:/data:ro", "w:/w"]
    assert merged["x"] == [2]
    assert base["services"]["a"]["environment"]["Y"] == "2"  # inputs untouched


def test_the_verifier_and_the_gateway_read_the_file_from_the_same_read_only_mount():
    doc = _own()
    kinds = racer_services(doc)
    models = {}
    for name, kind in kinds.items():
        if kind == "drafter":
            continue
        svc = doc["services"][name]
        env = compose_env(svc)
        models[kind] = env["RACER_MODEL"]
        mounts = [m.split(":") for m in svc["volumes"]]
        (src, target, mode) = next(m for m in mounts if _under(env["RACER_MODEL"], m[1]))
        assert src == GGUF_ENV["RACER_GGUF_DIR"] and mode == "ro", name
        assert env["RACER_MODEL"] == posixpath.join(target, GGUF_ENV["RACER_GGUF_FILE"])
        # the conversion's cache on a named volume (writable by the image's user, kept across restarts)
        (cache,) = [m for m in mounts if _under(env["RACER_CACHE"], m[1])]
        assert cache[0] in doc["volumes"] and len(cache) == 2, name
    assert effective("gateway", {"RACER_MODEL": models["gateway"]}, "RACER_MODEL") == models["verifier"]


def test_the_override_names_only_variables_the_services_read_and_drops_the_prior():
    doc = _own()
    for name, kind in racer_services(doc).items():
        env = compose_env(doc["services"][name])
        racer_vars = {k for k in env if k.startswith("RACER_")}
        assert racer_vars <= allowed_env(kind), f"{name} does not read {sorted(racer_vars - allowed_env(kind))}"
        for var in racer_vars & {"RACER_PRIOR", "RACER_MODEL"}:
            setting(kind, var).type(env[var])
        if kind == "drafter":
            assert env["RACER_PRIOR"] == "none", name
    # and without the override: the bundled model, the shipped prior
    plain = compose()
    for name in racer_services(plain):
        assert "RACER_PRIOR" not in compose_env(plain["services"][name])


def test_a_mistake_in_the_override_fails_validation():
    doc = _own()
    doc["services"]["verifier"]["volumes"].append(["/srv/models", "/models"])  # a list, not "src:dst" or a mapping
    with pytest.raises(jsonschema.ValidationError):
        _validator().validate(doc)


# --- Kubernetes --------------------------------------------------------------------------------------


def _mount_of(objs, service: str, path: str) -> tuple[dict, dict]:
    """(the volumeMount ``path`` lies under, its volume) in ``service``'s pod."""
    c = container(objs, service)
    (mount,) = [m for m in c["volumeMounts"] if _under(path, m["mountPath"])]
    pod = workload(objs, service)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def test_the_overlay_serves_one_file_from_a_read_only_claim_to_the_verifier_and_the_gateway():
    objs = render("own-model")
    claims = {c["metadata"]["name"] for c in of_kind(objs, "PersistentVolumeClaim")}
    models = set()
    for service in ("verifier", "gateway"):
        env = service_env(objs, service)
        model = env["RACER_MODEL"]
        assert model.endswith(".gguf") and model.startswith("/"), service
        models.add(model)
        mount, volume = _mount_of(objs, service, model)
        assert mount.get("readOnly") is True and "subPath" not in mount, service
        assert volume["persistentVolumeClaim"]["claimName"] in claims, service
        assert volume["persistentVolumeClaim"].get("readOnly") is True, service
        # the conversion goes to a writable volume (the root filesystem is read-only)
        cache_mount, cache_volume = _mount_of(objs, service, env["RACER_CACHE"])
        assert not cache_mount.get("readOnly") and "emptyDir" in cache_volume, service
        # and the first start, which converts, has ten minutes before liveness applies
        probe = container(objs, service)["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 600, service
    assert len(models) == 1
    assert service_env(objs, "drafter")["RACER_PRIOR"] == "none"
    for service in ("verifier", "gateway"):
        assert service_env(render("cpu"), service)["RACER_MODEL"] == "default"


def test_the_overlay_changes_only_what_serving_the_file_needs():
    def keyed(objs):
        return {(o["kind"], o["metadata"]["name"]): o for o in without_generated_suffixes(objs)}

    cpu, own = keyed(render("cpu")), keyed(render("own-model"))
    assert own.keys() - cpu.keys() == {("PersistentVolumeClaim", "racer-models")}
    assert cpu.keys() - own.keys() == set()
    changed = {key for key in cpu if cpu[key] != own[key]}
    assert changed == {
        ("Deployment", "racer-verifier"),
        ("Deployment", "racer-gateway"),
        ("ConfigMap", "racer-verifier-<hash>"),
        ("ConfigMap", "racer-gateway-<hash>"),
        ("ConfigMap", "racer-drafter-<hash>"),
    }
    claim = find(render("own-model"), "PersistentVolumeClaim", "racer-models")
    assert claim["metadata"]["namespace"] == "racer"
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
