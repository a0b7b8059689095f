"""What the benchmarks share: their markdown tables, and a stack of service processes with tenants of
their own (Redis, a verifier, drafters, a gateway per drafter; ``racer/procs.py`` starts each one on
addresses nothing else can take).

Timing stays in each benchmark (``time.perf_counter`` around what it measures, runs interleaved so
a noisy machine slows every side alike); percentiles come from ``racer/stats.py``."""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..client import Client
from ..procs import RedisServer, Service, scrape


def table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: ``head`` and one line per row of cells (already formatted)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def tenant_files(directory: str, tenants: Iterable[str], no_share: Iterable[str] = ()) -> dict[str, str]:
    """An API key per tenant, written to ``directory/keys``, and ``directory/limits.toml`` that turns
    sharing (the tenant corpus) off for the tenants in ``no_share``; returns the keys by tenant."""
    keys = {t: secrets.token_urlsafe(16) for t in tenants}
    with open(os.path.join(directory, "keys"), "w") as f:
        f.write("".join(f"{k} {t}\n" for t, k in keys.items()))
    with open(os.path.join(directory, "limits.toml"), "w") as f:
        f.write("".join(f'[tenants."{t}"]\nshare = false\n' for t in no_share))
    return keys


class Procs:
    """Service processes (``racer.procs``: each picks its own ports) with the settings they share;
    ``split``: (verifier CPUs, the others' CPUs), or None to let them share every CPU."""

    def __init__(self, base: dict[str, str], split, log_dir: str):
        self.base, self.split, self.log_dir = base, split, log_dir
        self.procs: list[Service] = []

    def start(self, kind: str, **env) -> Service:
        from common import cpus

        e = dict(self.base, **env)
        if self.split:
            e.update(cpus.placement(self.split, kind))
        p = Service(kind, e, Path(self.log_dir), f"{kind}{len(self.procs)}").start()
        self.procs.append(p)
        return p

    def healthy(self) -> None:
        """Waits until every process serves; ``ServiceFailed`` (which, and why) for one that exits."""
        from ..exits import wait_healthy

        for p in self.procs:
            wait_healthy(p)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()


@dataclass
class Replicas:
    """A running stack: gateway ``i`` sends every session to drafter ``i``."""

    gateways: list[str]
    drafter_metrics: list[int]  # the drafters' metrics ports
    verifier_metrics: int  # the verifier's metrics port
    keys: dict[str, str]  # tenant -> API key
    redis_url: str

    def client(self, replica: int, tenant: str, timeout: float = 600) -> Client:
        return Client(self.gateways[replica], api_key=self.keys[tenant], timeout=timeout)

    def scrape(self) -> list[dict]:
        """Every drafter's metrics."""
        return [scrape(p) for p in self.drafter_metrics]


@contextlib.contextmanager
def replicas(
    model: str,
    drafters: int,
    tenants: list[str],
    no_share: Iterable[str] = (),
    prior: bool = True,
    dtype: str | None = None,
    log_level: str = "WARNING",
    pin: bool = True,
    gateway_model: str | None = None,
    env: dict[str, str] | None = None,
):
    """Redis, a verifier, ``drafters`` drafters (all on that Redis, so tenant corpora replicate between
    them) and a gateway per drafter, as processes, with an API key per tenant and sharing off for
    ``no_share``; yields ``Replicas``, then stops them (SIGTERM, drain) and Redis. ``gateway_model``:
    the gateways' ``RACER_MODEL`` (``none``: token ids only), else ``model``; ``env``: more settings for
    every service (they win over these)."""
    from common import cpus
    from verifier.model import resolve_model_dir

    from ..stack import _TOKEN

    resolve_model_dir(model)
    with tempfile.TemporaryDirectory(prefix="racer-bench-stack-") as tmp:
        redis = RedisServer(Path(tmp) / "redis", appendonly=False).start()
        keys = tenant_files(tmp, tenants, no_share)
        base = dict(
            RACER_MODEL=model,
            RACER_LOG_LEVEL=log_level,
            RACER_INTERNAL_TOKEN=os.environ.get("RACER_INTERNAL_TOKEN") or _TOKEN,
        )
        if dtype:
            base["RACER_DTYPE"] = dtype
        base.update(env or {})
        procs = Procs(base, cpus.split_for_verifier(cpus.available()) if pin else None, tmp)
        try:
            # the verifier measures its cost curve at start-up: the others start once it is up
            verifier = procs.start("verifier")
            procs.healthy()
            gateways, dmetrics = [], []
            for _ in range(drafters):
                drafter = procs.start(
                    "drafter", RACER_SNAPSHOT_URL=redis.url, **({} if prior else {"RACER_PRIOR": "none"})
                )
                gateway = procs.start(
                    "gateway",
                    RACER_DRAFTERS=drafter.target,
                    RACER_VERIFIERS=verifier.target,
                    RACER_API_KEYS=os.path.join(tmp, "keys"),
                    RACER_TENANT_LIMITS=os.path.join(tmp, "limits.toml"),
                    **({"RACER_MODEL": gateway_model} if gateway_model else {}),
                )
                gateways.append(gateway.target)
                dmetrics.append(drafter.metrics_port)
            procs.healthy()
            yield Replicas(gateways, dmetrics, verifier.metrics_port, keys, redis.url)
        finally:
            procs.stop()
            redis.stop()
