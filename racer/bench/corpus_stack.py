"""``racer bench-corpus --through stack``: the repeat run through real services, drafter replicas apart.

Starts a ``redis-server`` (on a Unix socket), one verifier, ``--drafters`` drafter processes
(all on that Redis, so the tenant corpus replicates between them through its capped stream) and one
gateway per drafter, each sending its sessions to its own drafter only: the client picks the
replica by picking the gateway. (One gateway over all drafters would pick by rendezvous hashing of
the session id, which the gateway draws at random for a new session.) Every session is fresh and
runs one prompt. Pass 1 sends prompt ``i`` to replica ``i mod n``, pass 2 to replica ``i + 1 mod n``,
so consecutive sessions alternate and every repeat is answered by another replica than the first
answer: its corpus hits come from what replication brought over. Before pass 2 starts, the command
waits until every replica holds the whole of pass 1 (on ``racer_corpus_tokens``) and reports how
long that took. Which replica served each session is read from the drafters' metrics
(``racer_drafter_restores_total{source="new"}``), never assumed.

Tenants: one per budget with the corpus on (``corpus-c<C>``), and one with sharing off in the
tenant limits file (``no-corpus``) for the corpus off, each with an API key of its own.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

from drafter.corpora import decode, stream_key

from ..procs import sample, wait_for
from ..prompts import Prompt
from . import corpus, harness
from .corpus import Result, format_table, summarize
from .harness import Replicas

OFF = "no-corpus"
LAG = "racer_corpus_replication_lag_seconds"


def corpus_tenant(budget: int) -> str:
    return f"corpus-c{budget}"


def stream_contents(st: Replicas, tenant: str) -> tuple[int, int]:
    """(responses, tokens) in the tenant's corpus stream in Redis: what the replicas published."""
    import redis

    with redis.Redis.from_url(st.redis_url) as r:
        records = [decode(f[b"d"]) for _, f in r.xrange(stream_key(tenant))]
    return len({(rep, num) for _, rep, num, _ in records}), sum(len(t) for *_, t in records)


@contextlib.contextmanager
def replicas(model: str, drafters: int, tenants: list[str], **kw):
    """``harness.replicas`` with sharing off for ``OFF``: the processes of the repeat run."""
    with harness.replicas(model, drafters, tenants, no_share=[OFF], **kw) as st:
        yield st


def _new_sessions(samples: list[dict]) -> list[float]:
    return [sample(s, "racer_drafter_restores_total", source="new") for s in samples]


@dataclass
class StackRun:
    results: list[Result]
    sessions: dict[str, list[int]]  # pass -> sessions served by each replica (from the drafters' metrics)
    crossed: int  # pass-2 sessions served by another replica than their prompt's pass-1 session
    replication_s: dict[int, float]  # budget -> seconds from the end of pass 1 until every replica held it
    corpus_tokens: dict[int, list[float]]  # budget -> racer_corpus_tokens on each replica before pass 2
    lag: list[tuple[float, float]]  # per replica: (mean, count) of racer_corpus_replication_lag_seconds


def _warm(st: Replicas, tenants: list[str], budget: int, warm: str | list[int]) -> None:
    """Every replica loads each tenant's (empty) corpus, and the verifier warms up."""
    for r in range(len(st.gateways)):
        for t in tenants + [OFF]:
            st.client(r, t).complete(warm, max_new_tokens=4, mode="racer", budget=budget, share=False)
    wait_for(
        lambda: all(sample(s, "racer_corpus_load_seconds_count") >= len(tenants) for s in st.scrape()),
        120,
        "every replica loading the tenants' corpora",
    )


def _wait_replicated(
    st: Replicas, budgets: list[int], published: dict[int, tuple[int, int]], held: dict[int, list[float]]
):
    """Seconds, per budget, until every replica holds the whole of pass 1 (``published``: the
    (responses, tokens) its tenant's sessions generated, the last round of each included);
    ``held`` gets each replica's ``racer_corpus_tokens``."""
    replication: dict[int, float] = {}
    for b in budgets:
        t = corpus_tenant(b)

        def caught_up(b=b, t=t) -> bool:
            # every token of every pass-1 response in the stream, and every replica holding all of it
            responses, tokens = stream_contents(st, t)
            held[b] = [sample(s, "racer_corpus_tokens", tenant=t) for s in st.scrape()]
            want_responses, want_tokens = published[b]
            return responses >= want_responses and tokens >= want_tokens and set(held[b]) == {tokens}

        replication[b] = wait_for(
            caught_up,
            120,
            lambda b=b, t=t: (
                f"every replica holding the {published[b][0]} responses ({published[b][1]} tokens) of pass 1 of {t} "
                f"(tokens held: {held[b]})"
            ),
        )
    return replication


def _one_session(st: Replicas, replica: int, tenant: str, text, budget: int, max_new_tokens: int, system: str):
    """A fresh session of ``tenant`` through ``replica``'s gateway, checked to have landed on that
    replica's drafter: (output, its last answer, seconds, draft nodes by source, accepted by source)."""
    before = st.scrape()
    t = time.perf_counter()
    with st.client(replica, tenant) as c:
        out, _, last = c.complete(text, max_new_tokens=max_new_tokens, mode="racer", budget=budget, system=system)
    secs = time.perf_counter() - t
    after = st.scrape()
    landed = [j for j, (a, z) in enumerate(zip(_new_sessions(before), _new_sessions(after))) if z > a]
    if landed != [replica]:
        raise RuntimeError(f"session {last.session_id}: served by replicas {landed}, expected [{replica}]")
    drafted, accepted = (_by_source(before[replica], after[replica], k) for k in ("nodes", "accepted"))
    return out, last, secs, drafted, accepted


def run_stack(
    st: Replicas,
    prompts: list[tuple[Prompt, str | list[int]]],  # (prompt, its text or token ids)
    budgets: list[int],
    max_new_tokens: int,
    system: str,
    progress: bool = True,
    warm: str | list[int] = "Hello",
) -> StackRun:
    from tqdm import tqdm

    n = len(st.gateways)
    _warm(st, [corpus_tenant(b) for b in budgets], max(budgets), warm)
    lag_t0 = [(sample(s, f"{LAG}_sum"), sample(s, f"{LAG}_count")) for s in st.scrape()]
    results: list[Result] = []
    served = {g: [0] * n for g in ("pass 1", "pass 2")}
    first: dict[str, int] = {}  # prompt/budget -> the replica of its pass-1 session with the corpus
    crossed = 0
    published = {b: (0, 0) for b in budgets}  # pass-1 responses with the corpus on, and their tokens
    replication: dict[int, float] = {}
    held: dict[int, list[float]] = {}
    bar = tqdm(total=2 * len(prompts) * len(budgets) * 2, disable=not progress, file=sys.stderr, unit="session")
    for p_no, group in enumerate(("pass 1", "pass 2")):
        if p_no == 1:  # every replica holds the whole of pass 1 before pass 2 starts
            replication = _wait_replicated(st, budgets, published, held)
        for i, (p, text) in enumerate(prompts):
            replica = (i + p_no) % n
            for b in budgets:
                off = None
                for use in (False, True):
                    bar.set_description(f"stack {group} C={b} corpus {'on' if use else 'off'} replica {replica}")
                    tenant = corpus_tenant(b) if use else OFF
                    out, last, secs, drafted, accepted = _one_session(
                        st, replica, tenant, text, b, max_new_tokens, system
                    )
                    served[group][replica] += 1
                    r = Result(group, p.question_id, use, b, list(out), last.stats.rounds, secs, drafted, accepted)
                    if use:
                        key = f"{p.question_id}/{b}"
                        if group == "pass 1":
                            first[key] = replica
                            published[b] = (published[b][0] + 1, published[b][1] + len(out))
                        elif first[key] != replica:
                            crossed += 1
                        r.identical = off.identical = r.output == off.output
                    else:
                        off = r
                    results.append(r)
                    bar.update()
    bar.close()
    return StackRun(results, served, crossed, replication, held, _lag(st, lag_t0))


def _lag(st: Replicas, lag_t0: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per replica: (mean, count) of the replication lag recorded since ``lag_t0``."""
    lag = []
    for s, (s0, c0) in zip(st.scrape(), lag_t0):
        c = sample(s, f"{LAG}_count") - c0
        total = sample(s, f"{LAG}_sum") - s0
        lag.append((total / c if c else 0.0, c))
    return lag


def _by_source(before: dict, after: dict, what: str) -> dict:
    """Draft nodes (``what`` = nodes) or accepted nodes by source, the difference of two scrapes."""
    name = f"racer_draft_{what}_total"
    return {
        src: int(sample(after, name, source=src) - sample(before, name, source=src)) for src in ("session", "corpus")
    }


def gains(rows: list[dict], budget: int) -> dict:
    p1 = next(r for r in rows if r["group"] == "pass 1" and r["budget"] == budget)
    p2 = next(r for r in rows if r["group"] == "pass 2" and r["budget"] == budget)
    return dict(
        p1_off=p1["mat_off"],
        p1_on=p1["mat_on"],
        p2_off=p2["mat_off"],
        p2_on=p2["mat_on"],
        gain=p2["mat_on"] / p1["mat_on"],
    )


def format_comparison(single: list[dict], stack: list[dict], budgets: list[int], n: int, identical: dict) -> str:
    head = [
        "run",
        "C",
        "pass 1 MAT off",
        "pass 1 MAT on",
        "pass 2 MAT off",
        "pass 2 MAT on",
        "gain (pass 2 / pass 1, on)",
        "identical on/off",
    ]
    lines = []
    for b in budgets:
        g1, g2 = gains(single, b), gains(stack, b)
        for name, g, ident in (
            ("one replica, in process", g1, identical["single"]),
            (f"stack, {n} drafters", g2, identical["stack"]),
        ):
            cells = [name, str(b)] + [f"{g[k]:.2f}" for k in ("p1_off", "p1_on", "p2_off", "p2_on")]
            lines.append(cells + [f"{g['gain']:.2f}", ident])
    return harness.table(head, lines)


def report(single_results: list[Result], run: StackRun, budgets: list[int], n: int) -> str:
    single, stack = summarize(single_results), summarize(run.results)

    def pairs(rs: list[Result]) -> str:  # on/off pairs with equal outputs
        on = [r for r in rs if r.corpus]
        return f"{sum(1 for r in on if r.identical)}/{len(on)}"

    ident = {"single": pairs(single_results), "stack": pairs(run.results)}
    same = {(r.group, r.question_id, r.budget, r.corpus): r.output for r in single_results}
    equal = sum(1 for r in run.results if same.get((r.group, r.question_id, r.budget, r.corpus)) == r.output)
    lines = [format_comparison(single, stack, budgets, n, ident), ""]
    for b in budgets:
        g1, g2 = gains(single, b)["gain"], gains(stack, b)["gain"]
        lines.append(
            f"C={b}: the stack keeps {g2 / g1:.0%} of the single-replica gain ({g2:.2f} / {g1:.2f}; target >= 90%)"
        )
    lines.append(f"stack outputs equal to the in-process ones: {equal}/{len(run.results)}")
    lines.append(
        "sessions per replica (drafters' metrics): "
        + "; ".join(f"{g} {v}" for g, v in run.sessions.items())
        + f"; pass-2 sessions with the corpus answered by another replica than their first answer: "
        f"{run.crossed}/{sum(1 for r in run.results if r.corpus and r.group == 'pass 2')}"
    )
    for b in budgets:
        generated = sum(len(r.output) for r in run.results if r.group == "pass 1" and r.corpus and r.budget == b)
        lines.append(
            f"C={b}: every replica held pass 1 ({', '.join(f'{x:.0f}' for x in run.corpus_tokens[b])} corpus tokens "
            f"of the {generated} generated) {run.replication_s[b]:.2f} s after it ended"
        )
    lines.append(
        "replication lag over the run (racer_corpus_replication_lag_seconds, mean over records): "
        + ", ".join(f"replica {i} {m * 1000:.0f} ms over {c:.0f}" for i, (m, c) in enumerate(run.lag))
    )
    return "\n".join(lines)


def through_stack(args, prompts: list[Prompt], single: list[Result]) -> int:
    """The repeat run again through the services, ``--drafters`` replicas; beside the in-process one."""
    tenants = [corpus_tenant(b) for b in args.budget] + [OFF]
    with replicas(args.model, args.drafters, tenants, prior=args.prior, dtype=args.dtype) as st:
        run = run_stack(st, [(p, p.text) for p in prompts], args.budget, args.max_new_tokens, args.system or "")
    print(f"\nrepeat run through the stack: {args.drafters} drafter replicas, a gateway each, one verifier, Redis")
    print(format_table(summarize(run.results)))
    print()
    print(report(single, run, args.budget, args.drafters))
    if not all(r.identical for r in run.results):
        print("outputs through the stack differ with the corpus on and off", file=sys.stderr)
        return 1
    return 0


def main(args) -> int:
    if args.drafters < 2:
        raise ValueError(f"--drafters: {args.drafters}; --through stack needs 2 or more")
    if "repeat" not in args.runs:
        raise ValueError("--through stack runs the repeat run: add repeat to --runs")
    return corpus.main(args, after_repeat=through_stack)
