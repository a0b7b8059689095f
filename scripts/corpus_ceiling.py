"""How much a tenant corpus of one Spec-Bench category could ever give, scoring aside.

The category run of ``racer bench-corpus`` asks whether earlier responses of a category help the
next session of that category. This measures the most any corpus scoring could get from them: the
prompts of each category are answered in order (greedy, float32: the output is the target's own),
each response goes into the category's corpus after its session, and at every position of every
later response the corpus's candidates (up to 64 of the longest match, ``key_len`` tokens of key)
are compared with what the target generated. "offered" is the share of positions where some
candidate continues with the right next token; "depth" the mean length of the best candidate's
correct run, which bounds the tokens a round could gain from the corpus (an oracle that always picks
the right candidate, before any overlap with the session's own drafts). ``+prompts`` indexes the
prompts too; the last column is what the drafter's own scoring keeps of it. A second table
replays the answers with the session's retrieval and the corpus under a few scorings.

    PYTHONPATH=. python scripts/corpus_ceiling.py --per-category 8 --max-new-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

from common.loop import Stats
from common.text import chat_ids
from drafter.automaton import Automaton
from drafter.corpus import Corpus, CorpusConfig, Evidence
from drafter.draft_session import DrafterConfig, DraftSession
from drafter.tree import _Trie, add_corpus, add_logits, add_retrieval, corpus_candidates
from racer.inprocess import InProcessStack
from racer.prompts import DEFAULT_PROMPTS, load_spec_bench
from verifier.engine import VerifierSession


def outputs(args, engine) -> list[dict]:
    """Each prompt's chat ids, the target's greedy output and its top-k after every token of both
    (one forward over the whole; cached in ``--outputs``)."""
    if args.outputs and os.path.exists(args.outputs):
        return json.load(open(args.outputs))
    params = engine.default_params(max_new_tokens=args.max_new_tokens, mode="racer", budget=16)
    done = []
    for p in load_spec_bench(args.prompts, per_category=args.per_category):
        ids = chat_ids(engine.tokenizer, p.text, None)
        out: list[int] = []
        for chunk in engine.stream(ids, params, stats=Stats()):
            out += chunk
        verifier = VerifierSession(engine.loaded.model, engine.drafter_config.topk, engine.backend)
        topk = verifier.prefill(ids + out).topk
        done.append({"category": p.category, "prompt": ids, "output": out, "topk": topk})
        print(f"{p.category} {p.question_id}: {len(out)} tokens", file=sys.stderr)
    if args.outputs:
        with open(args.outputs, "w") as f:
            json.dump(done, f)
    return done


def _correct(path, out: list[int], i: int) -> int:
    """How many of ``path``'s tokens equal the output after position ``i``."""
    d = 0
    while d < len(path) and i + 1 + d < len(out) and path[d] == out[i + 1 + d]:
        d += 1
    return d


def ceiling(sessions: list[dict], key_len: int, with_prompts: bool) -> tuple[int, float, float]:
    """(positions, offered, depth) over one category's sessions in order (see the module doc)."""
    corpus = Corpus(CorpusConfig(key_len=key_len, max_candidates=64, max_scan=256))
    positions = offered = depth = 0
    for s in sessions:
        prompt, out = s["prompt"], s["output"]
        for i in range(len(out) - 1):
            _, conts = corpus.lookup(prompt + out[:i], out[i], 16)
            best = max((_correct(c, out, i) for c in conts), default=0)
            positions += 1
            offered += best > 0
            depth += best
        corpus.add(out)
        if with_prompts:
            corpus.add(prompt)
    return positions, offered / max(positions, 1), depth / max(positions, 1)


def scored(sessions: list[dict]) -> float:
    """The mean correct depth of what the drafter's own scoring keeps (``corpus_candidates`` with
    the default thresholds and no feedback yet; budget and overlap with the session's drafts
    aside): the part of the ceiling the scoring does not lose."""
    cfg = DrafterConfig()
    corpus = Corpus(CorpusConfig())
    positions = depth = 0
    for s in sessions:
        prompt, out = s["prompt"], s["output"]
        for i in range(len(out) - 1):
            found = corpus_candidates(corpus, prompt + out[:i], out[i], 16, cfg.corpus_min_match)
            kept = [path for value, path in found if value >= cfg.corpus_min_prob]
            positions += 1
            depth += max((_correct(p, out, i) for p in kept if _correct(p, out, i) == len(p)), default=0)
        corpus.add(out)
    return depth / max(positions, 1)


# Scorings replayed: (name, shortest match, least value, corpus before the session's retrieval)
SCORINGS = [("off", 0, 0.0, False), ("as built", 3, 0.25, False), ("corpus first", 3, 0.25, True)]
SCORINGS += [("match >= 4", 4, 0.25, False), ("value >= 0.1", 3, 0.1, False)]


def replay(sessions: list[dict], budget: int, min_match: int, min_prob: float, first: bool, on: bool):
    """Replays one category's answers with retrieval and corpus trees (no copy-logit tree: it needs
    the target's top-k); greedy, so a round accepts the longest tree path equal to the output. Each
    answer streams into the corpus round by round, as in the drafter and ``racer bench-corpus``.
    (MAT, corpus nodes drafted, accepted, rounds whose tree was full after the session's retrieval)."""
    cfg = DrafterConfig()
    corpus = Corpus(CorpusConfig()) if on else None
    rounds = tokens = drafted = accepted = full = 0
    for s in sessions:
        prompt, out = s["prompt"], s["output"]
        auto = Automaton(cfg.window, cfg.max_nodes)
        auto.extend(prompt)
        history = list(prompt)
        seen = Evidence()  # how this session's corpus nodes fared (the tenant's: corpus.evidence)
        drafted_here = 0
        writer = corpus.writer() if corpus is not None else None
        if writer is not None:
            corpus.append(writer, out[:1])  # the answer streams into the corpus as it is generated
        i = 0
        while i < len(out) - 1:
            trie = _Trie(out[i], budget)
            if first and corpus is not None:
                add_corpus(
                    trie,
                    corpus_candidates(
                        corpus, history, out[i], budget - 1, min_match, (corpus.evidence.pair(), seen.pair()), min_prob
                    ),
                    min_prob,
                )
            add_retrieval(trie, auto, out[i], cfg.min_depth, cfg.retrieval_min_prob)
            full += trie.full()
            if not first and corpus is not None and not trie.full():
                add_corpus(
                    trie,
                    corpus_candidates(
                        corpus, history, out[i], budget - 1, min_match, (corpus.evidence.pair(), seen.pair()), min_prob
                    ),
                    min_prob,
                )
            tree = trie.flatten(0)
            path = _accepted_path(tree, out, i)
            mine = set(tree.corpus_nodes)
            if mine:  # as DraftSession.count_accepted counts them
                got, tried = len(mine & set(path)), len({tree.parents[v] for v in mine} & set(path))
                seen.add(got, tried)
                corpus.evidence.add(got, tried)
                drafted_here += len(mine)
            fed = [tree.tokens[v] for v in path]
            auto.extend(fed)
            history += fed
            if writer is not None:
                corpus.append(writer, out[i + 1 : i + 1 + len(path)])  # accepted nodes and the bonus
            rounds += 1
            tokens += len(path)
            i += len(path)
        drafted += drafted_here
        accepted += seen.accepted
    return tokens / max(rounds, 1), drafted, accepted, full / max(rounds, 1)


def _accepted_path(tree, out: list[int], i: int) -> list[int]:
    """The tree's nodes (root first) a greedy target accepts after output position ``i``."""
    kids: dict[int, list[int]] = {}
    for v in range(1, len(tree)):
        kids.setdefault(tree.parents[v], []).append(v)
    path = [0]
    while True:
        d = len(path)
        nxt = [v for v in kids.get(path[-1], []) if i + d < len(out) and tree.tokens[v] == out[i + d]]
        if not nxt:
            return path
        path.append(nxt[0])


def _corpus_before_logits(s: DraftSession, root: int, budget: int):
    """The racer tree as the drafter built it before the corpus and the copy-logit tree competed
    by value: retrieval, then every corpus path worth ``corpus_min_prob``, then the copy-logit tree."""
    cfg = s.config
    trie = _Trie(root, budget)
    add_retrieval(trie, s.automaton, root, cfg.min_depth, cfg.retrieval_min_prob)
    if s.corpus is not None and not trie.full():
        seen = (s.corpus.evidence.pair(), s.corpus_evidence.pair())
        depth = budget - 1
        found = corpus_candidates(s.corpus, s.history, root, depth, cfg.corpus_min_match, seen, cfg.corpus_min_prob)
        add_corpus(trie, found, cfg.corpus_min_prob)
    add_logits(trie, s.table.get, cfg.topk)
    return trie.flatten(0)


def replay_sessions(sessions: list[dict], budget: int, prior, rule: str) -> tuple[float, int, int]:
    """Replays one category's answers through ``DraftSession`` (copy-logit tree included), the
    corpus ``rule`` being "off", "by value" (the drafter's) or "before logits" (the former order).
    The copy-logit table learns the target's top-k at the accepted positions only (a verifier also
    returns the rejected nodes'), so its trees are somewhat poorer than the drafter's in service.
    (MAT, corpus nodes drafted, accepted)."""
    corpus = Corpus(CorpusConfig()) if rule != "off" else None
    rounds = tokens = drafted = accepted = 0
    for rec in sessions:
        prompt, out, rows = rec["prompt"], rec["output"], rec["topk"]
        s = DraftSession(DrafterConfig(), prior)
        s.corpus = corpus
        s.extend(prompt, rows[: len(prompt)])
        writer = corpus.writer() if corpus is not None else None
        if writer is not None:
            corpus.append(writer, out[:1])
        i = 0
        while i < len(out) - 1:
            if rule == "before logits":
                tree = _corpus_before_logits(s, out[i], budget)
                s.note_draft(tree)
            else:
                tree = s.draft(out[i], budget)
            path = _accepted_path(tree, out, i)
            s.count_accepted(path)
            fed = [tree.tokens[v] for v in path]
            s.extend(fed, [rows[len(prompt) + i + d] for d in range(len(path))])
            if writer is not None:
                corpus.append(writer, out[i + 1 : i + 1 + len(path)])
            rounds += 1
            tokens += len(path)
            i += len(path)
        drafted += s.drafted["corpus"]
        accepted += s.accepted["corpus"]
    return tokens / max(rounds, 1), drafted, accepted


def print_session_replay(by: dict, budget: int, prior) -> None:
    """The replay through ``DraftSession`` at ``budget``: MAT by category under each corpus rule."""
    print(f"\nreplay at C={budget} through the drafter's session (copy-logit tree included): MAT by category")
    print("| corpus rule | " + " | ".join(by) + " | mean | corpus drafted / accepted |")
    print("|---|" + "---|" * (len(by) + 2))
    for rule in ("off", "before logits", "by value"):
        got = [replay_sessions(ss, budget, prior, rule) for ss in by.values()]
        mats = " | ".join(f"{g[0]:.3f}" for g in got)
        mean = sum(g[0] for g in got) / len(got)
        print(f"| {rule} | {mats} | {mean:.3f} | {sum(g[1] for g in got)} / {sum(g[2] for g in got)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--key-len", default="3,1", help="corpus key lengths to compare (3: the corpus as built)")
    ap.add_argument("--outputs", default="", help="JSON cache of the generated outputs")
    ap.add_argument("--replay-budget", type=int, default=64, help="tree size of the replay (0: no replay)")
    ap.add_argument("--session-budgets", default="16,64", help="tree sizes of the session replay ('': none)")
    args = ap.parse_args()
    engine = InProcessStack.load(threads=args.threads or None)
    by = defaultdict(list)
    for s in outputs(args, engine):
        by[s["category"]].append(s)
    for b in [int(x) for x in args.session_budgets.split(",") if x]:
        print_session_replay(by, b, engine.prior)
    keys = [int(k) for k in args.key_len.split(",")]
    cols = [(k, p) for k in keys for p in (False, True)]
    print(f"{args.per_category} sessions a category, {args.max_new_tokens} new tokens; offered / depth")
    heads = " | ".join(f"key {k}{' +prompts' if p else ''}" for k, p in cols)
    print(f"| category | positions | {heads} | depth kept by the scoring |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    for cat, sessions in by.items():
        cells = [ceiling(sessions, k, p) for k, p in cols]
        row = " | ".join(f"{o:.3f} / {d:.3f}" for _, o, d in cells)
        print(f"| {cat} | {cells[0][0]} | {row} | {scored(sessions):.3f} |")
    if not args.replay_budget:
        return
    print(f"\nreplay at C={args.replay_budget}, retrieval and corpus trees only: MAT by category")
    print("| scoring | " + " | ".join(by) + " | mean | corpus drafted / accepted | trees full after retrieval |")
    print("|---|" + "---|" * (len(by) + 3))
    for name, min_match, min_prob, first in SCORINGS:
        got = [replay(ss, args.replay_budget, min_match, min_prob, first, name != "off") for ss in by.values()]
        mats = " | ".join(f"{g[0]:.2f}" for g in got)
        mean = sum(g[0] for g in got) / len(got)
        nodes = f"{sum(g[1] for g in got)} / {sum(g[2] for g in got)}"
        print(f"| {name} | {mats} | {mean:.3f} | {nodes} | {sum(g[3] for g in got) / len(got):.2f} |")


if __name__ == "__main__":
    main()
