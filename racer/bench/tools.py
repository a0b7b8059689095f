"""``racer bench-tools``: function-calling sessions, tenant by tenant, with everything on and off.

Tenants are tool sets, sessions are conversations, and every session's system prompt is its tools'
JSON documentation (``racer/tool_sessions.py``: the input format, and the converter from BFCL).
A tenant's sessions run one after another, each turn by turn (the model's answer becomes the
assistant message before the next turn). Every session runs three times, interleaved session by
session so a noisy machine slows all three alike:

- ``on``: racer drafting with the tenant corpus (the tenant's earlier answers), under the tenant;
- ``corpus off``: racer drafting from the session alone, under a tenant of its own whose limits
  turn sharing off;
- ``off``: no drafts at all (the target alone), under a third tenant, sharing off.

Each run has its own tenant, so each sees the same sequence of first and later sessions (a prefix
cache scoped per tenant warms alike in all three). Greedy decoding: the outputs must be identical
in the three runs, and the command checks it.

Reported per tenant and overall: the first turn's time to first token (TTFT) of the tenant's first
session and the median of its later ones, in the ``on`` run; MAT (tokens per verification round)
and decoding tok/s (tokens after the first over the time after it) with the corpus on and off; the
verifier's prefix-cache hits, misses and prefill tokens saved, read from its metrics when it
exports them (``n/a`` otherwise, and always in process); the drafter's snapshot bytes per save in
the later sessions (those that can share the tenant's prompt start); and whether the outputs are
identical.

``--through stack`` (the default) starts Redis, a verifier, a drafter and a gateway as processes
and talks gRPC to the gateway; ``--through process`` runs the same sessions in this process
(``InProcessStack``: no gateway, no Redis, no prefix cache; the drafter keeps each session's state
across its turns, the verifier its KV cache).
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from dataclasses import dataclass, field

from ..procs import sample, scrape, wait_for
from ..tool_sessions import ToolSession, by_tenant, load
from . import harness

RUNS = ("on", "corpus off", "off")


@dataclass
class Turn:
    tokens: list[int]
    rounds: int
    ttft_s: float  # from sending the turn until its first token
    seconds: float  # the whole turn


@dataclass
class SessionRun:
    tenant: str
    index: int  # the session's place among its tenant's sessions (0: the first)
    run: str
    prompt_tokens: int  # the first turn's prompt, system prompt included (0: unknown)
    turns: list[Turn] = field(default_factory=list)
    prefix: dict | None = None  # the verifier's prefix-cache counters over this session (None: not exported)
    snapshot: tuple[float, float] = (0.0, 0.0)  # drafter snapshot (bytes, saves) over this session

    @property
    def output(self) -> list[list[int]]:
        return [t.tokens for t in self.turns]


# -- in process --------------------------------------------------------------------------------


class _ContinuingVerifier:
    """A verifier session across turns: each turn's prompt is the whole conversation so far, and only
    what the cache does not hold yet is prefilled."""

    def __init__(self, session):
        self.s = session

    @property
    def length(self) -> int:
        return self.s.length

    def prefill(self, tokens, topk_rows=None):
        return self.s.prefill(list(tokens[self.s.length :]), topk_rows=topk_rows)

    def verify(self, tokens, parents):
        return self.s.verify(tokens, parents)

    def truncate(self, length: int) -> None:
        self.s.truncate(length)


class _ContinuingDrafter:
    """A drafter session across turns: the prompt's tokens it already holds are not added again."""

    def __init__(self, session):
        self.s = session

    def extend(self, tokens, topk_rows=None):
        self.s.extend(list(tokens)[len(self.s.history) :], topk_rows)

    def observe_tree(self, tree_tokens, tree_topk, accepted):
        self.s.observe_tree(tree_tokens, tree_topk, accepted)

    def draft(self, root, budget, mode):
        return self.s.draft(root, budget, mode)


def _run_in_process(engine, session: ToolSession, run: str, budget: int, max_new: int, corpus) -> SessionRun:
    from common.loop import Stats, generate
    from common.text import continue_ids, messages_ids
    from verifier.engine import VerifierSession

    drafter = engine.new_drafter()
    drafter.corpus = corpus
    writer = corpus.writer() if corpus is not None else None
    verifier = VerifierSession(engine.loaded.model, engine.drafter_config.topk, engine.backend)
    eos = engine.loaded.eos_token_ids
    history: list[int] = []
    result = SessionRun(session.tenant, 0, run, 0)
    for i, turn in enumerate(session.turns):
        if i == 0:
            ids = messages_ids(engine.tokenizer, session.first_messages())
            result.prompt_tokens = len(ids)
        else:
            ids = history + continue_ids(engine.tokenizer, history, list(turn), eos)
        params = engine.default_params(max_new_tokens=max_new, mode="off" if run == "off" else "racer", budget=budget)
        stats = Stats()
        out: list[int] = []
        t0 = time.perf_counter()
        ttft = 0.0
        for chunk in generate(_ContinuingDrafter(drafter), _ContinuingVerifier(verifier), ids, params, stats):
            if not out:
                ttft = time.perf_counter() - t0
            out.extend(chunk)
            if writer is not None:
                corpus.append(writer, chunk)
        result.turns.append(Turn(out, stats.rounds, ttft, time.perf_counter() - t0))
        history = ids + out
    return result


def in_process(args, tenants: dict[str, list[ToolSession]]) -> list[SessionRun]:
    import torch
    from tqdm import tqdm

    from drafter.corpus import Corpus, CorpusConfig

    from ..inprocess import InProcessStack

    engine = InProcessStack.load(args.model, prior=args.prior, threads=args.threads or None, dtype=args.dtype)
    print(f"in process: torch threads {torch.get_num_threads()}; {engine.dtype}; greedy", file=sys.stderr)
    warm = ToolSession("warm", "warm", "", ((dict(role="user", content="Hello"),),))
    _run_in_process(engine, warm, "on", args.budget, 4, None)
    results = []
    bar = tqdm(total=sum(len(s) for s in tenants.values()) * len(RUNS), file=sys.stderr, unit="session")
    for name, sessions in tenants.items():
        corpus = Corpus(CorpusConfig(max_tokens=args.corpus_tokens))
        for i, s in enumerate(sessions):
            for run in RUNS:
                bar.set_description(f"{name[:16]} #{i} {run}")
                r = _run_in_process(engine, s, run, args.budget, args.max_new_tokens, corpus if run == "on" else None)
                r.index = i
                results.append(r)
                bar.update()
    bar.close()
    return results


# -- through the stack -------------------------------------------------------------------------


def _run_tenant_names(tenants: list[str]) -> dict[tuple[str, str], str]:
    """(data tenant, run) -> the tenant the run uses in the stack: short names, safe in the keys and
    limits files."""
    suffix = {"on": "", "corpus off": "-nocorpus", "off": "-off"}
    return {(t, run): f"t{i}{suffix[run]}" for i, t in enumerate(tenants) for run in RUNS}


def tool_stack(args, names: list[str], no_share: list[str]):
    """Redis, a verifier, a drafter and a gateway as processes (``harness.replicas``), a tenant per
    name; ``--env`` settings for every service."""
    env = dict(
        # one verifier: a prefill of thousands of tokens on a busy CPU may take minutes, and there is
        # nowhere to fail over to
        RACER_BACKEND_TIMEOUT="1800",
        **dict(kv.split("=", 1) for kv in args.env),
    )
    return harness.replicas(args.model, 1, names, no_share, prior=args.prior, dtype=args.dtype, pin=args.pin, env=env)


PREFIX_COUNTERS = ("hits", "misses", "saved")
SNAPSHOT = "racer_snapshot_bytes"  # the drafter's snapshot sizes (histogram)


def prefix_counters(samples: dict) -> dict | None:
    """The verifier's prefix-cache counters (hits, misses, prompt tokens copied instead of
    prefilled), summed over their other labels; None when it exports none. Names:
    ``racer_verifier_prefix_cache_lookups_total{outcome="hit"|"miss"}`` and
    ``racer_verifier_prefix_cache_saved_tokens_total``."""
    out = {k: 0.0 for k in PREFIX_COUNTERS}
    found = False
    for (name, labels), v in samples.items():
        if name == "racer_verifier_prefix_cache_lookups_total":
            outcome = dict(labels).get("outcome")
            if outcome not in ("hit", "miss"):
                continue
            out["hits" if outcome == "hit" else "misses"] += v
        elif name == "racer_verifier_prefix_cache_saved_tokens_total":
            out["saved"] += v
        else:
            continue
        found = True
    return out if found else None


def _run_stack_session(
    gateway: str, key: str, session: ToolSession, run: str, budget: int, max_new: int
) -> tuple[SessionRun, str]:
    from ..client import Client

    result = SessionRun(session.tenant, 0, run, 0)
    sid = ""
    with Client(gateway, api_key=key, timeout=1200) as c:
        for i, turn in enumerate(session.turns):
            messages = session.first_messages() if i == 0 else [dict(m) for m in turn]
            t0 = time.perf_counter()
            ttft = 0.0
            out: list[int] = []
            last = None
            for r in c.generate(
                messages, session_id=sid, max_new_tokens=max_new, mode="off" if run == "off" else "racer", budget=budget
            ):
                if r.token_ids and not out:
                    ttft = time.perf_counter() - t0
                out.extend(r.token_ids)
                last = r
            if i == 0:
                result.prompt_tokens = last.usage.prompt_tokens
            sid = last.session_id
            result.turns.append(Turn(out, last.stats.rounds, ttft, time.perf_counter() - t0))
    # the session stays open, as an agent's would (closing it would drop its drafter snapshot unmeasured)
    return result, sid


def _after_snapshot(port: int, count: float, timeout: float = 30.0) -> dict:
    """The drafter's metrics once the session's end-of-turn snapshot (written after the reply) is
    counted, or after ``timeout`` seconds without it."""
    samples = {}

    def saved() -> bool:
        samples.update(scrape(port))
        return sample(samples, f"{SNAPSHOT}_count") > count

    try:
        wait_for(saved, timeout, "the session's snapshot", every=0.1)
    except TimeoutError:
        pass
    return samples


def through_stack(args, tenants: dict[str, list[ToolSession]]) -> list[SessionRun]:
    from tqdm import tqdm

    names = _run_tenant_names(list(tenants))
    no_share = [n for (_, run), n in names.items() if run != "on"]
    results = []
    with tool_stack(args, list(names.values()), no_share) as st:
        gateway, keys, vport, dport = st.gateways[0], st.keys, st.verifier_metrics, st.drafter_metrics[0]
        print(f"stack: a verifier, a drafter, a gateway ({gateway}), Redis", file=sys.stderr)
        warm = ToolSession("warm", "warm", "", ((dict(role="user", content="Hello"),),))
        for n in names.values():  # every tenant's corpus loaded, the verifier warm
            _run_stack_session(gateway, keys[n], warm, "on", args.budget, 4)
        bar = tqdm(total=sum(len(s) for s in tenants.values()) * len(RUNS), file=sys.stderr, unit="session")
        for name, sessions in tenants.items():
            for i, s in enumerate(sessions):
                for run in RUNS:
                    bar.set_description(f"{name[:16]} #{i} {run}")
                    v0, d0 = scrape(vport), scrape(dport)
                    r, _ = _run_stack_session(
                        gateway, keys[names[(name, run)]], s, run, args.budget, args.max_new_tokens
                    )
                    v1, d1 = scrape(vport), _after_snapshot(dport, sample(d0, f"{SNAPSHOT}_count"))
                    before, after = prefix_counters(v0), prefix_counters(v1)
                    if before is not None and after is not None:
                        r.prefix = {k: after[k] - before[k] for k in PREFIX_COUNTERS}
                    r.snapshot = tuple(
                        sample(d1, f"{SNAPSHOT}_{x}") - sample(d0, f"{SNAPSHOT}_{x}") for x in ("sum", "count")
                    )
                    r.index = i
                    results.append(r)
                    bar.update()
        bar.close()
    return results


# -- the report --------------------------------------------------------------------------------


def _mat(rs: list[SessionRun]) -> float:
    tokens = sum(len(t.tokens) for r in rs for t in r.turns)
    rounds = sum(t.rounds for r in rs for t in r.turns)
    return tokens / rounds if rounds else 0.0


def _decode_tok_s(rs: list[SessionRun]) -> float:
    """Tokens after each turn's first over the time after it: decoding speed, prefill left out."""
    tokens = sum(max(0, len(t.tokens) - 1) for r in rs for t in r.turns)
    secs = sum(t.seconds - t.ttft_s for r in rs for t in r.turns)
    return tokens / secs if secs > 0 else 0.0


def summarize(results: list[SessionRun]) -> list[dict]:
    """One row per tenant, and an ``overall`` row (TTFT ratios: the median over tenants)."""
    rows = []
    tenants = list(dict.fromkeys(r.tenant for r in results))
    for t in tenants + ["overall"]:
        mine = [r for r in results if t in (r.tenant, "overall")]
        run = {k: [r for r in mine if r.run == k] for k in RUNS}
        on = run["on"]
        row = dict(tenant=t, sessions=len(on))
        if t != "overall":
            first = [r for r in on if r.index == 0]
            later = [r for r in on if r.index > 0]
            row["prompt_tokens"] = first[0].prompt_tokens if first else 0
            row["ttft_first"] = first[0].turns[0].ttft_s if first else float("nan")
            row["ttft_later"] = statistics.median(r.turns[0].ttft_s for r in later) if later else float("nan")
            row["ttft_ratio"] = row["ttft_later"] / row["ttft_first"] if later and first else float("nan")
        else:
            ratios = [x["ttft_ratio"] for x in rows if x["ttft_ratio"] == x["ttft_ratio"]]
            row["prompt_tokens"] = int(statistics.median(x["prompt_tokens"] for x in rows)) if rows else 0
            row["ttft_first"] = statistics.median(x["ttft_first"] for x in rows) if rows else float("nan")
            row["ttft_later"] = statistics.median(x["ttft_later"] for x in rows) if rows else float("nan")
            row["ttft_ratio"] = statistics.median(ratios) if ratios else float("nan")
        row["mat_on"], row["mat_nocorpus"] = _mat(on), _mat(run["corpus off"])
        row["tok_s_on"], row["tok_s_nocorpus"], row["tok_s_off"] = (_decode_tok_s(run[k]) for k in RUNS)
        prefix = [r.prefix for r in on]
        if prefix and all(p is not None for p in prefix):
            row["prefix"] = {k: sum(p[k] for p in prefix) for k in PREFIX_COUNTERS}
        later_on = [r for r in on if r.index > 0]  # the first session of a tenant shares nothing yet
        saves = sum(r.snapshot[1] for r in later_on)
        row["snapshot_kib"] = sum(r.snapshot[0] for r in later_on) / saves / 1024 if saves else None
        same = {(r.tenant, r.index, r.run): r.output for r in mine}
        identical = sum(
            1
            for r in on
            if same.get((r.tenant, r.index, "corpus off")) == r.output == same.get((r.tenant, r.index, "off"))
        )
        row["identical"] = f"{identical}/{len(on)}"
        row["all_identical"] = identical == len(on)
        rows.append(row)
    return rows


def _f(x, fmt: str) -> str:
    return "n/a" if x is None or x != x else format(x, fmt)


def format_table(rows: list[dict]) -> str:
    head = [
        "tenant",
        "sessions",
        "prompt tokens",
        "TTFT first s",
        "TTFT later s (median)",
        "later / first",
        "MAT on",
        "MAT corpus off",
        "MAT on / off",
        "tok/s on",
        "tok/s corpus off",
        "tok/s no drafts",
        "prefix hits / misses",
        "prefill tokens saved",
        "drafter snapshot KiB (later)",
        "identical on / off",
    ]
    lines = []
    for r in rows:
        p = r.get("prefix")
        cells = [
            r["tenant"],
            str(r["sessions"]),
            str(r["prompt_tokens"]),
            _f(r["ttft_first"], ".2f"),
            _f(r["ttft_later"], ".2f"),
            _f(r["ttft_ratio"], ".2f"),
            _f(r["mat_on"], ".2f"),
            _f(r["mat_nocorpus"], ".2f"),
            _f(r["mat_on"] / r["mat_nocorpus"] if r["mat_nocorpus"] else None, ".2f"),
            _f(r["tok_s_on"], ".1f"),
            _f(r["tok_s_nocorpus"], ".1f"),
            _f(r["tok_s_off"], ".1f"),
            f"{p['hits']:.0f} / {p['misses']:.0f}" if p else "n/a",
            f"{p['saved']:.0f}" if p else "n/a",
            _f(r["snapshot_kib"], ".0f"),
            r["identical"],
        ]
        lines.append(cells)
    return harness.table(head, lines)


def select(sessions: list[ToolSession], args) -> dict[str, list[ToolSession]]:
    """The first ``--tenants`` tenants (in the file's order) with at least two sessions and a first
    system prompt of at least ``--min-system-chars`` characters; their first ``--sessions`` sessions,
    each cut to its first ``--turns`` turns."""
    out = {}
    for name, ss in by_tenant(sessions).items():
        if len(out) >= args.tenants:
            break
        if len(ss) < 2 or len(ss[0].system) < args.min_system_chars:
            continue
        out[name] = [ToolSession(s.tenant, s.session, s.system, s.turns[: args.turns]) for s in ss[: args.sessions]]
    if not out:
        raise ValueError("no tenant with two sessions or more passes the selection (--min-system-chars?)")
    return out


def main(args) -> int:
    from .. import tool_sessions

    if args.convert:
        n = tool_sessions.convert_bfcl(args.input, args.convert)
        print(f"{args.input}: {n} sessions written to {args.convert}")
        return 0
    tenants = select(load(args.input), args)
    # a SIGTERM unwinds like Ctrl-C, so the stack's processes and Redis are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = (through_stack if args.through == "stack" else in_process)(args, tenants)
    rows = summarize(results)
    print(
        f"\n{len(tenants)} tenants, {args.max_new_tokens} new tokens a turn, C={args.budget}, through the "
        f"{args.through}, greedy; TTFT: the first turn's, 'on' run; tok/s: decoding (after the first token)"
    )
    print(format_table(rows))
    if not all(r["all_identical"] for r in rows):
        print("outputs differ between the runs with everything on and everything off", file=sys.stderr)
        return 1
    return 0
