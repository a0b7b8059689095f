"""A small Python equivalent of `kustomize build`, for the features k8s/ uses and nothing more.

Why: the tests must render the overlays on machines without kustomize (CI's machine has `kubectl`
with kustomize built in, a developer's may not). When `kubectl` is there, a test checks that this
renderer and `kubectl kustomize` produce the same objects, so the two cannot drift apart.

Supported (kustomize v5 semantics):
- `resources`: YAML files (multi-document) and directories holding a kustomization (bases).
- `namespace`: set on every namespaced object.
- `components`: directories holding a `kind: Component` kustomization, applied after the
  resources (their resources added, their generators and patches run on everything so far).
- `configMapGenerator` / `secretGenerator`: `envs` (KEY=VALUE files), `literals`, `files`
  (`key=path` or `path`); `behavior` create or merge; `options.labels`. Generated names get a 10-character content
  hash suffix, and references to them from pod templates are renamed (envFrom, env valueFrom,
  volumes). The suffix is computed like kustomize's but its digits differ from what `kubectl
  kustomize` prints (kustomize's exact hash input is not reproduced), so the comparison with kubectl
  replaces every generated suffix by a placeholder; what matters, and is checked, is that the
  suffix follows the content and that every reference points at the generated object.
- `patches` given by `path`: strategic-merge patches (the object to patch named by the patch's kind
  and metadata.name), with the Kubernetes merge keys of pod templates (containers by name, env by
  name, volumes by name, volumeMounts by mountPath, ports by containerPort); other lists replace;
  a null value removes the field; `$patch: delete` at the top of a patch removes the object.

Anything else in a kustomization (a new field, `target:` patches, other `$patch` directives, ...)
raises `Unsupported`, so a kustomization can never use a feature this renderer would silently ignore.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

KNOWN_FIELDS = {
    "apiVersion", "kind", "namespace", "resources", "components", "configMapGenerator", "secretGenerator", "patches"
}  # fmt: skip
GENERATOR_FIELDS = {"name", "behavior", "envs", "literals", "files", "options"}
GENERATOR_OPTIONS = {"labels"}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
    "StorageClass", "PriorityClass", "IngressClass", "RuntimeClass", "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration", "APIService",
}  # fmt: skip
# Strategic-merge keys of the lists a patch may reach in a pod template (from the Kubernetes API's
# x-kubernetes-patch-merge-key); every other list is replaced by the patch's.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


class Unsupported(Exception):
    """The kustomization uses something this renderer does not implement."""


@dataclass
class _Resource:
    obj: dict
    generated: bool = False  # gets a content-hash name suffix at the end of the build
    original_name: str = field(default="")

    def __post_init__(self):
        self.original_name = self.original_name or self.obj["metadata"]["name"]

    @property
    def key(self) -> tuple[str, str]:
        return self.obj["kind"], self.original_name


def build(directory: str | Path) -> list[dict]:
    """Renders the kustomization in ``directory`` like `kustomize build` (objects, not text)."""
    resources = _build(Path(directory))
    renames: dict[tuple[str, str], str] = {}
    for r in resources:
        if r.generated:
            name = f"{r.original_name}-{content_hash(r.obj)}"
            r.obj["metadata"]["name"] = name
            renames[r.key] = name
    out = [r.obj for r in resources]
    for obj in out:
        _rename_references(obj, renames)
    return out


def _build(directory: Path, resources: list[_Resource] | None = None, kind: str = "Kustomization") -> list[_Resource]:
    """``resources``: what a kustomization that uses this component has so far (changed in place)."""
    path = directory / "kustomization.yaml"
    k = yaml.safe_load(path.read_text())
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise Unsupported(f"{path}: {sorted(unknown)}")
    if k.get("kind", "Kustomization") != kind:
        raise Unsupported(f"{path}: kind {k.get('kind')}, expected {kind}")

    resources = [] if resources is None else resources
    for entry in k.get("resources", []):
        target = directory / entry
        if target.is_dir():
            resources += _build(target)
        else:
            resources += [_Resource(doc) for doc in yaml.safe_load_all(target.read_text()) if doc]
    for entry in k.get("components", []):
        _build(directory / entry, resources, "Component")

    for kind, entries in (("ConfigMap", k.get("configMapGenerator", [])), ("Secret", k.get("secretGenerator", []))):
        for g in entries:
            _generate(directory, kind, g, resources)

    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise Unsupported(f"{path}: patch {patch} (only `path:` strategic-merge patches)")
        for doc in yaml.safe_load_all((directory / patch["path"]).read_text()):
            _apply_patch(resources, doc, f"{directory / patch['path']}")

    if "namespace" in k:
        for r in resources:
            if r.obj["kind"] not in CLUSTER_SCOPED:
                r.obj["metadata"]["namespace"] = k["namespace"]
    return resources


def _generate(directory: Path, kind: str, g: dict, resources: list[_Resource]) -> None:
    unknown = set(g) - GENERATOR_FIELDS
    if unknown:
        raise Unsupported(f"{kind} generator {g.get('name')}: {sorted(unknown)}")
    data: dict[str, str] = {}
    for env_file in g.get("envs", []):
        data.update(parse_env_file(directory / env_file))
    for literal in g.get("literals", []):
        key, value = literal.split("=", 1)
        data[key] = value
    for entry in g.get("files", []):
        key, _, file = entry.rpartition("=")
        file_path = directory / file
        data[key or file_path.name] = file_path.read_text()
    if kind == "Secret":
        data = {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}

    behavior = g.get("behavior", "create")
    if behavior == "merge":
        matches = [r for r in resources if r.key == (kind, g["name"]) and r.generated]
        if len(matches) != 1:
            raise Unsupported(f"merge into {kind} {g['name']}: {len(matches)} generated objects of that name")
        matches[0].obj.setdefault("data", {}).update(data)
        return
    if behavior != "create":
        raise Unsupported(f"{kind} generator behavior {behavior!r}")
    obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": g["name"]}, "data": data}
    if kind == "Secret":
        obj["type"] = "Opaque"
    options = g.get("options", {})
    if set(options) - GENERATOR_OPTIONS:
        raise Unsupported(f"{kind} generator {g['name']}: options {sorted(set(options) - GENERATOR_OPTIONS)}")
    if "labels" in options:
        obj["metadata"]["labels"] = dict(options["labels"])
    resources.append(_Resource(obj, generated=True))


def parse_env_file(path: Path) -> dict[str, str]:
    """kustomize's env-file rules: leading blanks dropped, `#` lines and empty lines skipped,
    KEY=VALUE split at the first `=`, the value kept verbatim. A bare KEY (kustomize would read
    the builder's environment) is refused: rendering must not depend on who renders."""
    out = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise Unsupported(f"{path}:{number}: {key} has no value (would be read from the environment)")
        if not ENV_NAME.match(key):
            raise ValueError(f"{path}:{number}: {key!r} is not a valid environment variable name")
        out[key] = value
    return out


def content_hash(obj: dict) -> str:
    """A name suffix for a generated ConfigMap or Secret in kustomize's style: sha256 of the JSON
    encoding of kind, name, data (and type for a Secret), first 10 hex digits, 0,1,3,a,e mapped to
    g,h,k,m,t. Changes whenever the data does."""
    encoded = {"kind": obj["kind"], "name": obj["metadata"]["name"], "data": obj.get("data") or {}}
    if obj["kind"] == "Secret":
        encoded["type"] = obj.get("type", "Opaque")
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # Go's encoding/json escapes these three for HTML safety.
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _apply_patch(resources: list[_Resource], patch: dict, where: str) -> None:
    kind, name = patch["kind"], patch["metadata"]["name"]
    matches = [r for r in resources if r.key == (kind, name)]
    if len(matches) != 1:
        raise Unsupported(f"{where}: patch for {kind}/{name} matches {len(matches)} objects")
    if patch.get("$patch") == "delete":
        resources.remove(matches[0])
        return
    matches[0].obj = strategic_merge(matches[0].obj, patch)


def strategic_merge(base, patch, field_name: str = ""):
    """Strategic-merge ``patch`` into ``base`` (new object; neither argument is changed)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(key.startswith("$") for key in patch):
            raise Unsupported(f"patch directive in {field_name}: {[k for k in patch if k.startswith('$')]}")
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list) and field_name in MERGE_KEYS:
        merge_key = MERGE_KEYS[field_name]
        out, new = copy.deepcopy(base), []
        for item in patch:
            index = next((i for i, b in enumerate(out) if b.get(merge_key) == item.get(merge_key)), None)
            if index is None:
                new.append(copy.deepcopy(item))
            else:
                out[index] = strategic_merge(out[index], item, field_name)
        return new + out  # kustomize puts the patch's new items first, in the patch's order
    return copy.deepcopy(patch)


def _rename_references(obj: dict, renames: dict[tuple[str, str], str]) -> None:
    if obj["kind"] not in WORKLOADS:
        return
    pod = obj["spec"]["template"]["spec"]

    def rename(ref: dict, kind: str, key: str) -> None:
        if ref and (kind, ref.get(key)) in renames:
            ref[key] = renames[kind, ref[key]]

    for container in pod.get("containers", []) + pod.get("initContainers", []):
        for source in container.get("envFrom", []):
            rename(source.get("configMapRef"), "ConfigMap", "name")
            rename(source.get("secretRef"), "Secret", "name")
        for env in container.get("env", []):
            value_from = env.get("valueFrom", {})
            rename(value_from.get("configMapKeyRef"), "ConfigMap", "name")
            rename(value_from.get("secretKeyRef"), "Secret", "name")
    for volume in pod.get("volumes", []):
        rename(volume.get("configMap"), "ConfigMap", "name")
        rename(volume.get("secret"), "Secret", "secretName")
        if "projected" in volume:
            raise Unsupported("projected volumes")
