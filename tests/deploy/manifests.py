"""Loading the deployment files the way their tools read them, for the tests in this package.

- k8s/: rendered with the Python kustomize equivalent in ``kustomize.py`` (base and overlays).
- docker-compose.yml: YAML with anchors and merge keys, then compose's `${VAR}` / `${VAR:-default}`
  / `${VAR-default}` / `${VAR:?error}` interpolation with every variable unset but the secrets the
  deployment guide (docs/deployment/index.md) has the user put in `.env` (``COMPOSE_SECRETS``):
  the defaults a fresh checkout gets.
- Dockerfile: the official BuildKit parser (the `dockerfile` package), heredoc bodies read back
  from the file.
"""

from __future__ import annotations

import copy
import functools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

from common import settings

from . import kustomize

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
RENDERS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "gpu": K8S / "overlays" / "gpu",
    "mtls": K8S / "overlays" / "mtls",
    "cpu-openai": K8S / "overlays" / "cpu-openai",  # cpu with the gateway's HTTP API on
    "own-model": K8S / "overlays" / "own-model",  # cpu serving a GGUF file from a volume
}
OVERLAYS = ("cpu", "gpu", "mtls", "own-model")
SERVICES = tuple(settings.PORTS)  # gateway, drafter, verifier
COMPONENT_LABEL = "app.kubernetes.io/component"
# Variables a service reads besides the settings table: its two ports (common/settings.py
# add_arguments) and the model cache directory (verifier/paths.py cache_root).
EXTRA_ENV = {"RACER_PORT", "RACER_METRICS_PORT", "RACER_CACHE"}
GENERATED_SUFFIX = re.compile(r"-[a-z0-9]{10}$")


# --- common/settings.py ------------------------------------------------------------------------------


def allowed_env(service: str) -> set[str]:
    return settings.env_names(service) | EXTRA_ENV


def setting(service: str, env: str) -> settings.Setting:
    for s in settings.COMMON + settings.SERVICE[service]:
        if s.env == env:
            return s
    raise KeyError(env)


def effective(service: str, env: dict[str, str], name: str):
    """The value the service ends up with for ``name``: the environment's, else the table default."""
    s = setting(service, name)
    return s.type(env[name]) if name in env else s.default


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- Kubernetes -------------------------------------------------------------------------------------


@functools.cache
def _render(name: str) -> tuple[dict, ...]:
    return tuple(kustomize.build(RENDERS[name]))


def render(name: str) -> list[dict]:
    """Objects of k8s/base or an overlay (a fresh copy: tests may change it)."""
    return copy.deepcopy(list(_render(name)))


def find(objs: list[dict], kind: str, name: str) -> dict:
    """The object of that kind whose name is ``name`` (or ``name`` plus a generated suffix)."""
    hits = [
        o for o in objs
        if o["kind"] == kind and name in (o["metadata"]["name"], GENERATED_SUFFIX.sub("", o["metadata"]["name"]))
    ]  # fmt: skip
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} objects"
    return hits[0]


def of_kind(objs: list[dict], *kinds: str) -> list[dict]:
    return [o for o in objs if o["kind"] in kinds]


def workload(objs: list[dict], service: str) -> dict:
    """The Deployment running ``service`` (by its component label)."""
    hits = [
        o for o in of_kind(objs, "Deployment")
        if o["spec"]["template"]["metadata"]["labels"].get(COMPONENT_LABEL) == service
    ]  # fmt: skip
    assert len(hits) == 1, f"{service}: {len(hits)} Deployments"
    return hits[0]


def container(objs: list[dict], service: str) -> dict:
    containers = workload(objs, service)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{service}: one container expected"
    return containers[0]


def container_env(objs: list[dict], c: dict) -> dict[str, str]:
    """A container's environment as the kubelet builds it: envFrom sources in order, then env. A
    value from a Secret (which the repository does not hold) reads ``secret_value(name, key)``."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"unexpected envFrom source {source}"
        env.update(find(objs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for entry in c.get("env", []):
        if "valueFrom" in entry:
            ref = entry["valueFrom"]["secretKeyRef"]  # the only kind of reference used
            env[entry["name"]] = secret_value(ref["name"], ref["key"])
            continue
        assert "value" in entry, f"{entry['name']}: a literal value or a Secret key"
        env[entry["name"]] = entry["value"]
    return env


def secret_value(name: str, key: str) -> str:
    """What stands for key ``key`` of Secret ``name`` in ``container_env``."""
    return f"<secret {name}/{key}>"


def service_env(objs: list[dict], service: str) -> dict[str, str]:
    return container_env(objs, container(objs, service))


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are used"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def without_generated_suffixes(obj):
    """``obj`` with every generated ConfigMap/Secret name suffix replaced by a placeholder."""
    if isinstance(obj, dict):
        return {k: without_generated_suffixes(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [without_generated_suffixes(v) for v in obj]
    if isinstance(obj, str) and obj.startswith("racer-") and GENERATED_SUFFIX.search(obj):
        return GENERATED_SUFFIX.sub("-<hash>", obj)
    return obj


def cpu_quantity(q) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


# --- docker-compose.yml -----------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}|\$\$")
# What the deployment guide has the user write into .env before `docker compose up` (compose refuses to start
# without them: `${VAR:?...}`).
COMPOSE_SECRETS = {
    "RACER_REDIS_PASSWORD": "a-redis-password-for-tests",
    "RACER_INTERNAL_TOKEN": "an-internal-token-for-tests",
}


class MissingVariable(ValueError):
    """A `${VAR:?message}` whose variable is unset (compose stops with the message)."""


def interpolate(value, env: dict[str, str] | None = None):
    """Compose variable interpolation (the subset used: ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}, ${VAR?error}, $$)."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m):
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group("name"), m.group("op"), m.group("default")
        if name in env and (env[name] or op not in (":-", ":?")):
            return env[name]
        if op in (":?", "?"):
            raise MissingVariable(f"{name}: {default}")
        return default if op else ""

    return _INTERPOLATION.sub(sub, value)


def compose_raw(*overrides: str) -> dict:
    """docker-compose.yml, and each override file named (``docker compose -f docker-compose.yml -f
    NAME``) merged over it in order (``merge_compose``)."""
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in overrides:
        doc = merge_compose(doc, yaml.safe_load((ROOT / name).read_text()))
    return doc


def compose(*overrides: str, env: dict[str, str] | None = None) -> dict:
    return interpolate(compose_raw(*overrides), COMPOSE_SECRETS | (env or {}))


def merge_compose(base, override):
    """Compose's merge of an override file, for what the files here use: mappings merge key by key
    (``environment`` too), a service's ``volumes`` by their target path, other lists and scalars are
    replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            if k == "volumes" and isinstance(v, list) and isinstance(base.get(k), list):
                targets = {_volume_target(m): m for m in base[k]} | {_volume_target(m): m for m in v}
                out[k] = list(targets.values())
            else:
                out[k] = merge_compose(base[k], v) if k in base else copy.deepcopy(v)
        return out
    return copy.deepcopy(override)


def _volume_target(mount) -> str:
    return mount["target"] if isinstance(mount, dict) else mount.split(":")[1]


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def seconds(duration: str) -> float:
    """A compose duration ('1m30s', '20s', '500ms') in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


# --- Dockerfile -------------------------------------------------------------------------------------


@dataclass
class Instruction:
    cmd: str  # upper case: FROM, RUN, COPY, ...
    flags: tuple[str, ...]
    value: tuple[str, ...]
    json: bool
    original: str
    heredoc: str | None  # the body of a `<<EOF` heredoc, if any
    stage: int  # index of the FROM this instruction belongs to (-1: before any)


@functools.cache
def dockerfile() -> tuple[Instruction, ...]:
    import dockerfile as parser  # the BuildKit parser, from PyPI `dockerfile`

    path = ROOT / "Dockerfile"
    lines = path.read_text().splitlines()
    out, stage = [], -1
    for c in parser.parse_file(str(path)):
        cmd = c.cmd.upper()
        if cmd == "FROM":
            stage += 1
        heredoc = None
        marker = next((v for v in c.value if v.startswith("<<")), None)
        if marker:
            delimiter = marker.lstrip("<-").strip("'\"")
            body = lines[c.start_line : c.end_line]  # the lines after the instruction's own
            assert body and body[-1] == delimiter, f"heredoc {delimiter} at line {c.start_line}"
            heredoc = "\n".join(body[:-1]) + "\n"
        out.append(Instruction(cmd, tuple(c.flags), tuple(c.value), c.json, c.original, heredoc, stage))
    return tuple(out)


def dockerfile_args(stage: int | None = None) -> dict[str, str]:
    """ARG defaults (of one stage, or of every stage and the global scope)."""
    out = {}
    for i in dockerfile():
        if i.cmd == "ARG" and (stage is None or i.stage == stage):
            name, _, default = i.value[0].partition("=")
            out[name] = default
    return out


def dockerfile_env(stage: int) -> dict[str, str]:
    out = {}
    for i in dockerfile():
        if i.cmd == "ENV" and i.stage == stage:
            out.update(zip(i.value[::2], i.value[1::2]))
    return out


def final_stage() -> int:
    return max(i.stage for i in dockerfile())


def image_argv(entrypoint: list[str] | None, command: list[str] | None) -> list[str]:
    """What a container of the image runs, given the entrypoint/command overrides (None: image's)."""
    image_entrypoint = next(list(i.value) for i in reversed(dockerfile()) if i.cmd == "ENTRYPOINT")
    image_cmd = next(list(i.value) for i in reversed(dockerfile()) if i.cmd == "CMD")
    if entrypoint is not None:
        return list(entrypoint) + list(command or [])
    return image_entrypoint + list(image_cmd if command is None else command)
