"""The tenant corpus on agentic sessions: what the drafter reaches beside the best any choice of
corpus candidates could do (an oracle replay).

Function-calling sessions (``racer/tool_sessions.py``; BFCL v4 by default), tenant by tenant: each
session's first turn (the tools' docs as the system prompt) is answered greedily in float32 (the
target's own output) and the target's top-k after every position is recorded (one forward over
prompt and answer; cached in ``--outputs``). The answers are then replayed through ``DraftSession``
(retrieval, copy-logit tree and the tenant corpus, which each answer enters round by round as it is
generated, as in the drafter service), greedy, so a round accepts the longest tree path equal to
the output:

- ``off``: no corpus;
- ``drafter``: the drafter's own choice of corpus candidates (``DraftSession.draft``);
- ``oracle``: at every round, the best of the session's own tree (no corpus) and of the trees that
  take any one candidate path the corpus offers (every continuation of its longest match, up to 64,
  as deep as the budget allows), placed right after the session's retrieval with the copy-logit
  tree filling what is left. A greedy round accepts one path, so one right candidate is all any
  choice could add: this bounds every scoring of the candidates.

Reported per tenant and overall: MAT of each, the drafter's share of the oracle's gain
(``(drafter - off) / (oracle - off)``), and whether the drafter is never below ``off``. The
copy-logit table learns from the accepted positions only here (a verifier also returns the rejected
nodes' top-k), so the absolute MATs are somewhat below the service's; the three rules see the same.

    PYTHONPATH=$PWD .venv/bin/python scripts/corpus_oracle_tools.py --tenants 3 --sessions 6 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the same accepted-path walk the Spec-Bench ceiling replays with (scripts/ is this script's path)
from corpus_ceiling import _accepted_path  # noqa: E402

from common.loop import Stats  # noqa: E402
from common.text import messages_ids  # noqa: E402
from drafter.corpus import Corpus, CorpusConfig  # noqa: E402
from drafter.draft_session import DrafterConfig, DraftSession  # noqa: E402
from drafter.tree import _Trie, add_corpus, add_logits, add_retrieval  # noqa: E402
from racer.tool_sessions import by_tenant, load  # noqa: E402

DEFAULT_INPUT = Path(__file__).resolve().parents[2] / "shared" / "data" / "bfcl" / "BFCL_v4_live_multiple.json"


def outputs(args) -> list[dict]:
    """Per session: tenant, prompt ids, the target's greedy answer and the top-k after every token.
    With ``--outputs``, each session is appended to that JSONL file as it is done, and sessions already
    there are not generated again."""
    done = []
    if args.outputs and os.path.exists(args.outputs):
        with open(args.outputs) as f:
            done = [json.loads(line) for line in f if line.strip()]
    have = {(r["tenant"], r["session"]) for r in done}
    chosen = [
        (name, ss[: args.sessions])
        for name, ss in by_tenant(load(args.input)).items()
        if len(ss) >= 2 and args.min_system_chars <= len(ss[0].system) <= args.max_system_chars
    ][: args.tenants]
    todo = [(name, s) for name, ss in chosen for s in ss if (name, s.session) not in have]
    if args.cached_only:
        todo = []
    if todo:
        from racer.inprocess import InProcessStack
        from verifier.engine import VerifierSession

        engine = InProcessStack.load(threads=args.threads or None)
        params = engine.default_params(max_new_tokens=args.max_new_tokens, mode="racer", budget=16)
    for name, s in todo:
        ids = messages_ids(engine.tokenizer, s.first_messages())
        out: list[int] = []
        for chunk in engine.stream(ids, params, stats=Stats()):
            out += chunk
        verifier = VerifierSession(engine.loaded.model, engine.drafter_config.topk, engine.backend)
        topk = verifier.prefill(ids + out).topk
        rec = {"tenant": name, "session": s.session, "prompt": ids, "output": out, "topk": topk}
        done.append(rec)
        if args.outputs:
            with open(args.outputs, "a") as f:
                f.write(json.dumps(rec) + "\n")
        print(f"{name} {s.session}: {len(ids)} prompt tokens, {len(out)} answered", file=sys.stderr)
    wanted = {(name, s.session) for name, ss in chosen for s in ss}
    return [r for r in done if (r["tenant"], r["session"]) in wanted]


def _tree_with(s: DraftSession, root: int, budget: int, candidate) -> object:
    """The session's tree with one corpus path placed after its retrieval (None: without the corpus)."""
    cfg = s.config
    trie = _Trie(root, budget)
    add_retrieval(trie, s.automaton, root, cfg.min_depth, cfg.retrieval_min_prob)
    if s.view is not None and not trie.full():
        add_retrieval(trie, s.view, root, cfg.min_depth, cfg.retrieval_min_prob)
    if candidate:  # the path and each of its prefixes, as the merge takes them (a parent first)
        add_corpus(trie, [(1.0, tuple(candidate[: k + 1])) for k in range(len(candidate))], 0.0)
    add_logits(trie, s.table.get, cfg.topk)
    return trie.flatten(0)


def _oracle_tree(s: DraftSession, corpus: Corpus, root: int, budget: int, out: list[int], i: int):
    """The tree, of the session's own and those with any one corpus candidate, that gains the most."""
    best = _tree_with(s, root, budget, None)
    best_len = len(_accepted_path(best, out, i))
    _, conts = corpus.lookup(s.history, root, budget - 1)
    for c in conts:
        if not c:
            continue
        tree = _tree_with(s, root, budget, c)
        n = len(_accepted_path(tree, out, i))
        if n > best_len:
            best, best_len = tree, n
    return best


def replay(sessions: list[dict], budget: int, prior, rule: str, cfg: DrafterConfig = DrafterConfig()):
    """One tenant's answers in order under ``rule`` (off, drafter, oracle): (tokens, rounds)."""
    corpus = Corpus(CorpusConfig()) if rule != "off" else None
    rounds = tokens = 0
    for rec in sessions:
        prompt, out, rows = rec["prompt"], rec["output"], rec["topk"]
        s = DraftSession(cfg, prior)
        s.corpus = corpus if rule == "drafter" else None
        s.extend(prompt, rows[: len(prompt)])
        writer = corpus.writer() if corpus is not None else None
        if writer is not None:
            corpus.append(writer, out[:1])  # the answer streams into the corpus as it is generated
        i = 0
        while i < len(out) - 1:
            if rule == "oracle":
                tree = _oracle_tree(s, corpus, out[i], budget, out, i)
            else:
                tree = s.draft(out[i], budget)
            path = _accepted_path(tree, out, i)
            s.count_accepted(path)
            fed = [tree.tokens[v] for v in path]
            s.extend(fed, [rows[len(prompt) + i + d] for d in range(len(path))])
            if writer is not None:
                corpus.append(writer, out[i + 1 : i + 1 + len(path)])  # accepted nodes and the bonus
            rounds += 1
            tokens += len(path)
            i += len(path)
    return tokens, rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", default=str(DEFAULT_INPUT), help="tool sessions: JSONL or a BFCL file")
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=6, help="per tenant, in order")
    ap.add_argument("--min-system-chars", type=int, default=0)
    ap.add_argument("--max-system-chars", type=int, default=10**9)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--budgets", default="16,64", help="tree sizes C (comma-separated)")
    ap.add_argument("--min-match", type=int, default=DrafterConfig.corpus_min_match, help="the drafter's")
    ap.add_argument("--min-prob", type=float, default=DrafterConfig.corpus_min_prob, help="the drafter's")
    ap.add_argument("--cached-only", action="store_true", help="replay the answers --outputs holds, generate none")
    ap.add_argument("--outputs", default="", help="JSONL cache of the generated answers (appended, resumed)")
    args = ap.parse_args()
    from common.priors import load_prior

    recs = outputs(args)
    prior = load_prior("default", DrafterConfig().topk)
    cfg = DrafterConfig(corpus_min_match=args.min_match, corpus_min_prob=args.min_prob)
    tenants: dict[str, list[dict]] = {}
    for r in recs:
        tenants.setdefault(r["tenant"], []).append(r)
    print(
        f"{len(tenants)} tenants, {len(recs)} sessions (first turns), answers of up to {args.max_new_tokens} tokens; "
        "replayed greedy; MAT = tokens per round"
    )
    print(
        "| C | tenant | sessions | MAT off | MAT drafter | MAT oracle | drafter's share of the gain | drafter >= off |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for budget in (int(b) for b in args.budgets.split(",") if b):
        totals = {rule: [0, 0] for rule in ("off", "drafter", "oracle")}
        for name, ss in list(tenants.items()) + [("overall", None)]:
            if ss is None:
                mat = {rule: t / max(r, 1) for rule, (t, r) in totals.items()}
                n = len(recs)
            else:
                mat = {}
                for rule in totals:
                    t, r = replay(ss, budget, prior, rule, cfg)
                    totals[rule][0] += t
                    totals[rule][1] += r
                    mat[rule] = t / max(r, 1)
                n = len(ss)
            gain = mat["oracle"] - mat["off"]
            share = f"{(mat['drafter'] - mat['off']) / gain:.0%}" if gain > 1e-9 else "n/a (no gain possible)"
            print(
                f"| {budget} | {name} | {n} | {mat['off']:.3f} | {mat['drafter']:.3f} | {mat['oracle']:.3f} | {share} "
                f"| {'yes' if mat['drafter'] >= mat['off'] else '**no**'} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
