"""The prefix cache and prefix-aware placement, measured (a script that prints tables, not a test).

    python -m racer.bench.prefix [--tenants 2] [--sessions 4] [--prompt-tokens 3000] [--placement-sessions 6]

1. Prefill. Each tenant's system prompt is tool documentation from BFCL (function docs of its
   tool sets, to about ``--prompt-tokens`` tokens with the model's tokenizer and chat template);
   its sessions are one user question each. Two verifier cores in this process, the prefix cache
   on and off, run the same sessions side by side (each session on both, in alternating order): the
   first turn's prefill time of a tenant's first session and of its later ones, medians. Outputs
   (greedy, ``--new-tokens``) are compared on/off.
2. Placement. Two verifiers, one drafter and two gateways over gRPC in this process. Tool sets
   (each its own system prompt) open sessions one after another through both gateways in turn;
   a later session counts as placed on the prefix when it lands on the verifier that held the
   longest cached prefix of its prompt when it was placed (sessions are closed after their turn:
   the prefix cache keeps their blocks). Then the verifier holding the most is saturated (a
   stream reserving 82% of its KV memory) and each tool set opens one more session: they should
   all go to the other one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import secrets
import statistics
import sys
from pathlib import Path

from common import settings

from ..prompts import BFCL
from .harness import table

BFCL_MULTIPLE = BFCL / "BFCL_v4_live_multiple.json"
SYSTEM = "You can call these functions. Answer with a JSON call of one of them.\n"


def tool_sets(path: Path) -> list[tuple[list[dict], list[str]]]:
    """BFCL entries grouped by tool set: (functions, user questions), the sets with most questions first."""
    groups: dict[str, tuple[list[dict], list[str]]] = {}
    for line in path.read_text().splitlines():
        e = json.loads(line)
        key = json.dumps(e["function"], sort_keys=True)
        user = next(m["content"] for turn in e["question"] for m in turn if m["role"] == "user")
        groups.setdefault(key, (e["function"], []))[1].append(user)
    return sorted(groups.values(), key=lambda g: -len(g[1]))


def tenant_prompts(tokenizer, sets, tenants: int, tokens: int, sessions: int) -> list[tuple[str, list[list[int]]]]:
    """Per tenant: (its system prompt, its sessions' prompts as token ids). A tenant's docs are its
    tool set's, then other sets' (``tenants`` apart) until they reach ``tokens`` tokens."""
    from common.text import chat_ids

    out = []
    for t in range(tenants):
        functions, users, j = [], list(sets[t][1]), t
        while True:
            functions += sets[j % len(sets)][0]
            system = SYSTEM + json.dumps(functions, indent=1)
            if len(tokenizer(system)["input_ids"]) >= tokens or j > len(sets) * 2:
                break
            j += tenants
        while len(users) < sessions:  # a small set: other sets' questions too
            users += sets[(t + len(users)) % len(sets)][1]
        out.append((system, [chat_ids(tokenizer, u, system) for u in users[:sessions]]))
    return out


async def _session(v, tenant: str, sid: str, ids: list[int], new: int):
    from verifier.sessions import Open

    e = v.claim(Open(tenant, sid, ids))
    opened = await v.open(e, ids, reserve_tokens=new)
    out = [opened.next_token]
    while len(out) < new:
        out.append((await v.verify(e, [out[-1]], [-1])).next_token)
    v.release(e)
    v.drop(tenant, sid)  # only the prefix cache keeps its rows
    await v._run(lambda: None, tenant=tenant)  # its blocks are copied into the cache
    return out, opened


def prefill_table(model, prompts, new: int) -> tuple[str, dict]:
    from verifier.sessions import Verifier

    on, off = Verifier(model, prefix_cache=True), Verifier(model, prefix_cache=False)
    rows, same, total = [], 0, 0
    first_on, later_on, later_off, saved = [], [], [], []

    async def go():
        nonlocal same, total
        for v in (on, off):  # the first forwards pay for kernel selection and allocation: not measured
            await _session(v, "warm-up", "w", prompts[0][1][0][:200], 2)
        for t, (_system, sessions) in enumerate(prompts):
            for i, ids in enumerate(sessions):
                # the two sides alternate which goes first, so a drift of the machine's speed favours neither
                if (t + i) % 2:
                    b, ob = await _session(off, f"t{t}", f"s{i}", ids, new)
                    a, oa = await _session(on, f"t{t}", f"s{i}", ids, new)
                else:
                    a, oa = await _session(on, f"t{t}", f"s{i}", ids, new)
                    b, ob = await _session(off, f"t{t}", f"s{i}", ids, new)
                same += a == b
                total += 1
                (first_on if i == 0 else later_on).append(oa.elapsed_ms)
                if i:
                    later_off.append(ob.elapsed_ms)
                    saved.append(oa.prefix_tokens)
                rows.append((f"t{t}", i, len(ids), oa.prefix_tokens, oa.elapsed_ms, ob.elapsed_ms))

    asyncio.run(go())
    on.close()
    off.close()
    head = ("tenant", "session", "prompt tokens", "from the cache", "prefill, cache on (ms)", "prefill, cache off (ms)")
    lines = [table(head, ((t, str(i), str(n), str(c), f"{a:.0f}", f"{b:.0f}") for t, i, n, c, a, b in rows))]
    med = {
        "first": statistics.median(first_on),
        "later": statistics.median(later_on),
        "later_off": statistics.median(later_off),
    }
    lines.append("")
    lines.append(
        f"median first-session prefill {med['first']:.0f} ms, later sessions {med['later']:.0f} ms with the cache "
        f"({med['later'] / med['first']:.3f}x the first), {med['later_off']:.0f} ms without it; "
        f"tokens from the cache per later session: median {statistics.median(saved):.0f}; "
        f"outputs identical on/off: {same}/{total}"
    )
    return "\n".join(lines), med


# -- placement -------------------------------------------------------------------------------------


class _Rig:
    """Two verifiers (``--placement-kv-tokens`` of KV memory each), one drafter and two gateways over
    gRPC in this process, and the calls the placement run makes to them."""

    BLOCK = 64  # the prefix cache's block, in tokens

    def __init__(self, model, args):
        from common import identity

        self.model, self.args = model, args
        self.token = secrets.token_urlsafe(32)
        self.meta = identity.metadata((self.token,))
        self.verifiers: list = []
        self.drafter = None
        self.gateways: list = []

    async def start(self) -> None:
        from racer import launch
        from verifier.gguf_blocks import cache_dtype
        from verifier.kv_memory import kv_bytes_per_token

        per_token = kv_bytes_per_token(self.model.config, cache_dtype(self.model).itemsize)
        for _ in range(2):
            vargs = launch.defaults(
                "verifier", host="127.0.0.1", port=0, internal_token=self.token, measure_cost=False, max_sessions=64
            )
            vargs.kv_memory_bytes = self.args.placement_kv_tokens * per_token
            self.verifiers.append(await launch.start_verifier(vargs, model=self.model))
        self.targets = [f"127.0.0.1:{s.port}" for s, _ in self.verifiers]
        self.drafter = await launch.start_drafter(
            launch.defaults("drafter", host="127.0.0.1", port=0, internal_token=self.token, prior="none")
        )
        for _ in range(2):
            g = await launch.start_gateway(
                launch.defaults(
                    "gateway",
                    host="127.0.0.1",
                    port=0,
                    model="none",
                    internal_token=self.token,
                    backend_timeout=3600.0,  # a prefill on a busy machine is slow, not lost
                    drafters=f"127.0.0.1:{self.drafter[0].port}",
                    verifiers=",".join(self.targets),
                ),
                vocab_size=self.model.config.vocab_size,
            )
            g[1].backends.load_every = 0.0
            self.gateways.append(g)

    async def stop(self) -> None:
        for srv, _ in self.gateways + ([self.drafter] if self.drafter else []) + self.verifiers:
            await srv.stop(0)
        for _, core in self.verifiers:
            core.close()

    def stats(self, i: int):
        import grpc

        from common.v1 import verifier_pb2 as vpb
        from common.v1 import verifier_pb2_grpc as vgrpc

        with grpc.insecure_channel(self.targets[i]) as ch:
            return vgrpc.VerifierStub(ch).Stats(vpb.VerifierStatsRequest(), timeout=30, metadata=self.meta)

    def held(self, i: int, tenant: str, ids: list[int]) -> int:
        """Blocks of ``ids`` verifier ``i``'s prefix cache holds for ``tenant``, from the first on."""
        from common.prefix import chain_keys, key_id

        have = set(self.stats(i).prefix_blocks)
        keys = [key_id(k) for k in chain_keys(tenant, ids, self.BLOCK)]
        return next((j for j, k in enumerate(keys) if k not in have), len(keys))

    def complete(self, g: int, ids: list[int]) -> tuple[int, str]:
        """A short turn through gateway ``g``, its session closed: (the verifier it ran on, its tenant)."""
        from racer.client import Client

        with Client(f"127.0.0.1:{self.gateways[g][0].port}", timeout=600) as c:
            _, _, last = c.complete(ids, max_new_tokens=4, budget=4)
            sid = last.session_id
            where = [i for i in range(2) if any(s.session_id == sid for s in self.stats(i).sessions)]
            tenant = next(s.tenant for s in self.stats(where[0]).sessions if s.session_id == sid)
            c.close_session(sid)  # its KV goes; the prefix cache keeps the blocks
        return where[0], tenant


def _sessions_placed(rig: _Rig, prompts, sessions: int) -> tuple[int, int]:
    """Every tool set's sessions through both gateways in turn: (later sessions, those placed on the
    verifier holding most of their prefix when they were placed)."""
    on_prefix = later = 0
    tenant = None
    n = 0
    for i in range(sessions):
        for _system, ids_of in prompts:
            ids = ids_of[i % len(ids_of)]
            hold = [rig.held(v, tenant, ids) if tenant else 0 for v in range(2)]
            where, tenant = rig.complete(n % 2, ids)
            n += 1
            if i:
                later += 1
                on_prefix += max(hold) > 0 and hold[where] == max(hold)
    return later, on_prefix


def _sessions_beside_a_saturated_verifier(rig: _Rig, prompts) -> tuple[int, float, int]:
    """The verifier holding most blocks saturated by a stream reserving most of its KV memory, then
    one more session per tool set: (that verifier, its saturation, sessions placed on the other)."""
    import grpc

    from common.v1 import verifier_pb2 as vpb
    from common.v1 import verifier_pb2_grpc as vgrpc

    busy = max(range(2), key=lambda v: len(rig.stats(v).prefix_blocks))
    core = rig.verifiers[busy][1]
    mem = core.kv_memory
    rows = int(0.82 * mem.total - (mem.used - core.prefix_bytes)) // mem.per_token
    q: queue.Queue = queue.Queue()
    op = vpb.VerifierOpen(session_id="hog", tenant="hog", history=[1, 2, 3], reserve_tokens=rows - 3 - core.headroom)
    q.put(vpb.VerifyRequest(open=op))
    other = 0
    with grpc.insecure_channel(rig.targets[busy]) as ch:
        call = vgrpc.VerifierStub(ch).Session(iter(q.get, None), timeout=600, metadata=rig.meta)
        next(call)
        sat = rig.stats(busy).saturation
        for g, (_system, ids_of) in enumerate(prompts):
            where, _ = rig.complete(g % 2, ids_of[0])
            other += where != busy
        q.put(None)
        with contextlib.suppress(grpc.RpcError):
            for _ in call:
                pass
    return busy, sat, other


async def _placement(model, prompts, args) -> str:
    rig = _Rig(model, args)

    def run() -> str:
        later, on_prefix = _sessions_placed(rig, prompts, args.placement_sessions)
        busy, sat, other = _sessions_beside_a_saturated_verifier(rig, prompts)
        return (
            table(
                ("later sessions", "on the verifier holding their prefix", "share"),
                [(str(later), str(on_prefix), f"{on_prefix / max(1, later):.0%}")],
            )
            + "\n\n"
            f"verifier {busy} saturated ({sat:.2f}): {other}/{len(prompts)} new sessions went to the other"
        )

    try:
        await rig.start()
        return await asyncio.to_thread(run)
    finally:
        await rig.stop()


def main(argv: list[str] | None = None) -> int:
    p = settings.CommandParser(prog="python -m racer.bench.prefix", description=__doc__.split("\n\n")[0])
    settings.add_flag(p, "verifier", "--model")
    p.add_argument("--data", default=str(BFCL_MULTIPLE), help="BFCL JSON lines (tool sets and questions)")
    p.add_argument("--tenants", type=int, default=2, help="tenants of the prefill run (0: no prefill run)")
    p.add_argument("--sessions", type=int, default=4, help="sessions per tenant (the first and the later ones)")
    p.add_argument("--prompt-tokens", type=int, default=3000, help="system prompt size (tool docs), in tokens")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per session (outputs compared)")
    settings.add_flag(p, "verifier", "--threads", default=2)
    p.add_argument("--placement-sessions", type=int, default=6, help="sessions per tool set (0: no placement run)")
    p.add_argument("--placement-sets", type=int, default=3, help="tool sets (system prompts) in the placement run")
    p.add_argument("--placement-tokens", type=int, default=500, help="system prompt tokens in the placement run")
    p.add_argument("--placement-kv-tokens", type=int, default=16384, help="each placement verifier's KV memory")
    args = p.parse_args(argv)

    from verifier.model import load

    loaded = load(args.model, dtype="float32", threads=args.threads or None)
    sets = tool_sets(Path(args.data))
    prompts = (
        tenant_prompts(loaded.tokenizer, sets, args.tenants, args.prompt_tokens, args.sessions) if args.tenants else []
    )
    print(f"model {loaded.path.name}, float32, {args.threads} threads; BFCL tool docs as system prompts\n")
    if args.tenants:
        table, _ = prefill_table(loaded.model, prompts, args.new_tokens)
        print(table)
        sys.stdout.flush()
    if args.placement_sessions:
        short = tenant_prompts(
            loaded.tokenizer, sets[args.tenants :], args.placement_sets, args.placement_tokens, args.placement_sessions
        )
        print(f"placement: {len(short)} tool sets, system prompts of {[len(p[1][0]) for p in short]} tokens")
        print()
        print(asyncio.run(_placement(loaded.model, short, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
