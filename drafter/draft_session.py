"""One session's drafting state, ``DraftSession``: learn from verified positions, build the next draft tree.

Pure: no I/O, no clocks. The service layer owns sessions, snapshots and timing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from common import settings
from common.costs import ContextSlope
from common.params import MODES

from .adaptive import BudgetChooser, round_kind
from .automaton import Automaton
from .copy_logits import CopyLogitTable
from .corpus import Evidence
from .prefixes import PrefixView, SharedPrefix
from .tree import (
    DraftTree,
    _Trie,
    add_logits,
    add_logits_best_first,
    add_retrieval,
    corpus_candidates,
    merge_corpus,
)

AUTO = 0  # budget: chosen per round from the verifier's cost curve (``DraftSession.set_costs``)
PROBES = 4  # positions of a rest that ``catch_up`` drafts for the budget's statistics, at most


@dataclass(frozen=True)
class DrafterConfig:
    # The served drafter's settings take their defaults from the settings table (common/settings.py).
    window: int = settings.default("drafter", "--window")  # n: longest n-gram in the automaton
    max_nodes: int = settings.default("drafter", "--max-nodes")  # automaton capacity per session (root included)
    topk: int = settings.default("drafter", "--topk")  # k: copy-logit row width and root breadth of the logits tree
    min_depth: int = 2  # shortest (suffix + root) string that counts as a retrieval border
    retrieval_min_prob: float = 0.0  # drop retrieval candidates less likely than this
    pld_ngram: int = 3  # longest n-gram prompt lookup matches
    # Logits-tree shape: "halving" (RACER: breadth-first, breadth halves per level and sibling) or
    # "best-first" (spend the budget on the nodes most likely to be accepted, by rank prior).
    logits_tree: str = settings.default("drafter", "--logits-tree")
    # Tenant corpus: the shortest match (root included) it drafts from, and the least value
    # (frequency x the chance that every token of the path is accepted, see
    # ``tree.corpus_candidates``) of a node it adds. The corpus's key is 3 tokens, so 3 sets no floor
    # beyond it: how short a match is still worth drafting from follows from the evidence
    # (``tree.corpus_confidence``).
    corpus_min_match: int = 3
    corpus_min_prob: float = 0.25

    def __post_init__(self):
        if self.topk < 1 or self.min_depth < 1 or self.pld_ngram < 1:
            raise ValueError("topk, min_depth and pld_ngram must be >= 1")
        if self.logits_tree not in ("halving", "best-first"):
            raise ValueError(f"logits_tree={self.logits_tree!r}: expected 'halving' or 'best-first'")
        Automaton(self.window, self.max_nodes)  # validates window / capacity


class DraftSession:
    """State of one session: the context (committed tokens), automaton, copy-logit table."""

    def __init__(self, config: DrafterConfig = DrafterConfig(), prior=None):
        self.config = config
        self.automaton = Automaton(config.window, config.max_nodes)
        self.table = CopyLogitTable(config.topk, prior)
        self.last_topk: tuple[int, ...] = ()  # distribution that chose the current root
        self.history: list[int] = []  # committed tokens, for prompt lookup and snapshots' replay
        # n-gram -> end indices of its last two occurrences (the last may have no continuation yet)
        self._ngram_last: dict[tuple[int, ...], tuple[int, int]] = {}
        self.chooser: BudgetChooser | None = None
        self.corpus = None  # the tenant's ``corpus.Corpus`` to draft from, if any (its text read only here)
        # Tree nodes (root excluded) drafted and accepted, by source: "session" (automaton and
        # copy-logit table) or "corpus". ``_corpus_nodes``: the last tree's corpus nodes (None: no
        # tree since its acceptance was counted), ``_corpus_parents`` their parents.
        self.drafted = {"session": 0, "corpus": 0}
        self.accepted = {"session": 0, "corpus": 0}
        self._corpus_nodes: frozenset[int] | None = None
        self._corpus_parents: frozenset[int] = frozenset()
        # How this session's corpus nodes fared (``corpus.Evidence``); the last tree's corpus
        # nodes count here and in the evidence of the corpus they came from (``_corpus_evidence``).
        self.corpus_evidence = Evidence()
        self._corpus_evidence: Evidence | None = None
        # A shared prompt prefix (drafter/prefixes.py) this session begins with: its automaton is read
        # through ``view``, its copy-logit rows through the table's base; ``automaton``, the table's
        # own rows and the n-gram index hold what comes after it.
        self.prefix: SharedPrefix | None = None
        self.view: PrefixView | None = None

    def attach_prefix(self, prefix: SharedPrefix, tail=None) -> None:
        """Begins this session with ``prefix`` (shared, never copied): a new session (``tail`` None),
        or a restored one whose automaton and rows already hold ``tail``, the tokens after it. A new
        session's own automaton starts with the prefix's last ``window - 1`` tokens, so the n-grams
        across the boundary are its own."""
        if self.history:
            raise ValueError("a shared prefix begins a session: this one already holds tokens")
        self.prefix = prefix
        self.table.base = prefix.rows
        self.history = list(prefix.tokens)
        if tail is None:
            self.automaton.extend(prefix.tokens[len(prefix) - self.prefix_seed :])
            tail = ()
        self.view = PrefixView(prefix, (prefix.tokens[-self.config.window :] + tuple(tail))[-self.config.window :])
        self._index(tail)

    @property
    def prefix_seed(self) -> int:
        """Tokens of the shared prefix the session's own automaton holds too (its last ones)."""
        return min(self.config.window - 1, len(self.prefix)) if self.prefix is not None else 0

    def set_costs(
        self,
        cost_ms: dict[int, float],
        overhead_ms: float = 1.0,
        plain_overhead_ms: float | None = None,
        slope: ContextSlope | None = None,
    ) -> None:
        """The verifier's cost curve (ms per forward by tree size): enables ``budget=AUTO``.
        ``plain_overhead_ms``: a round without the drafter costs that beyond its forward, which lets
        the budget choose to rest (``BudgetChooser``); None: every round is drafted. ``slope``: what
        the context adds to the curve (each round priced at the session's length)."""
        self.chooser = BudgetChooser(cost_ms, overhead_ms, plain_overhead_ms=plain_overhead_ms, slope=slope)

    @property
    def rest(self) -> int:
        """Rounds the adaptive budget's last choice left to verify without a tree (0: draft the next)."""
        return self.chooser.rest if self.chooser is not None else 0

    # -- learning ---------------------------------------------------------------------------------
    def extend(self, tokens, topk_rows=None) -> None:
        """Commits context tokens; ``topk_rows`` (optional): the target's top-k after each of the last
        ``len(topk_rows)`` tokens, in order (a prefill may send back fewer rows than it fed)."""
        tokens = list(tokens)
        if topk_rows is not None and len(topk_rows) > len(tokens):
            raise ValueError(f"topk_rows: {len(topk_rows)} rows for {len(tokens)} tokens")
        self.automaton.extend(tokens)
        if self.view is not None:
            self.view.extend(tokens)
        if topk_rows:
            self.table.put_many(tokens[len(tokens) - len(topk_rows) :], topk_rows)
            self.last_topk = tuple(topk_rows[-1])
        self._index(tokens)
        if self.chooser is not None and tokens:
            self.chooser.observe(self.history)

    def catch_up(self, tokens, topk_rows, mode: str = "racer") -> None:
        """Commits ``tokens`` verified without a tree while the budget rested (``topk_rows``: the
        target's top-k after each), drafting the big tree at up to ``PROBES`` of them, evenly
        spread, as it would have been drafted there: the budget's statistics keep following the
        text, so that it can choose trees again. The probes count nowhere else."""
        tokens = list(tokens)
        if len(topk_rows) != len(tokens):
            raise ValueError(f"topk_rows: {len(topk_rows)} rows for {len(tokens)} tokens")
        n = len(tokens)
        probes = set() if self.chooser is None else {i * n // PROBES for i in range(min(n, PROBES))}
        for i, (t, row) in enumerate(zip(tokens, topk_rows)):
            if i in probes:
                self.chooser.drafted(len(self.history), self._draft(t, self.chooser.largest, mode, 0))
            self.extend([t], [row])

    def _index(self, tokens) -> None:
        """Appends ``tokens`` to the history and its n-gram index (prompt lookup)."""
        hist = self.history
        idx = self._ngram_last
        g = self.config.pld_ngram
        for t in tokens:
            hist.append(t)
            end = len(hist) - 1
            for size in range(1, min(g, len(hist)) + 1):
                key = tuple(hist[end - size + 1 :])
                idx[key] = (end, idx.get(key, (-1, -1))[0])

    def observe_tree(self, tree_tokens, tree_topk, accepted: list[int]) -> None:
        """Learns from a verified tree: every node's top-k, accepted path last (most recent wins).

        ``accepted`` are indices into the tree of the accepted path (root first). Call ``extend``
        with the accepted tokens afterwards.
        """
        acc = set(accepted)
        self.count_accepted(accepted)
        put = self.table.put
        for i, (t, row) in enumerate(zip(tree_tokens, tree_topk)):
            if i not in acc:
                put(t, row)
        for i in accepted:
            put(tree_tokens[i], tree_topk[i])
        if accepted:
            self.last_topk = tuple(tree_topk[accepted[-1]])

    def count_accepted(self, accepted) -> None:
        """Counts the last tree's accepted nodes (indices, root first) by source; a tree's are
        counted once (a second call before the next draft counts nothing)."""
        if self._corpus_nodes is None:
            return
        acc = set(accepted)
        from_corpus = len(acc & self._corpus_nodes)
        self.accepted["corpus"] += from_corpus
        self.accepted["session"] += max(0, len(acc) - 1 - from_corpus)
        if self._corpus_nodes:
            tried = len(self._corpus_parents & acc)
            self.corpus_evidence.add(from_corpus, tried)
            if self._corpus_evidence is not None:
                self._corpus_evidence.add(from_corpus, tried)
        self._corpus_nodes = None

    # -- drafting ---------------------------------------------------------------------------------
    def draft(self, root: int, budget: int, mode: str = "racer", batch_rows: int = 0) -> DraftTree:
        """A tree of at most ``budget`` nodes (root included) rooted at ``root``.

        ``batch_rows``: with the adaptive budget, rows of other sessions verified in the same
        forward (their presence changes what a bigger tree costs)."""
        return self.note_draft(self._draft(root, budget, mode, batch_rows))

    def note_draft(self, tree: DraftTree) -> DraftTree:
        """Counts ``tree``'s nodes as drafted, by source, and keeps its corpus nodes for
        ``count_accepted`` (``draft`` does; a tree built otherwise, for a replay, may go through it)."""
        n_corpus = len(tree.corpus_nodes)
        self.drafted["corpus"] += n_corpus
        self.drafted["session"] += len(tree) - 1 - n_corpus
        self._corpus_nodes = frozenset(tree.corpus_nodes)
        self._corpus_parents = frozenset(tree.parents[i] for i in tree.corpus_nodes)
        self._corpus_evidence = getattr(self.corpus, "evidence", None) if n_corpus else None
        return tree

    def _draft(self, root: int, budget: int, mode: str, batch_rows: int) -> DraftTree:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        if budget == AUTO and mode != "off":
            if self.chooser is None:
                raise ValueError("budget=0 (adaptive) needs the verifier's cost curve (set_costs)")
            full = self._draft(root, self.chooser.largest, mode, 0)
            self.chooser.drafted(len(self.history), full)
            return full.prefix(self.chooser.choose(batch_rows, len(self.history), round_kind(full)))
        if budget < 0:  # (0 reaches here only with mode "off", which drafts nothing)
            raise ValueError("budget must be >= 1 (or 0: adaptive)")
        cfg = self.config
        trie = _Trie(root, budget)
        if mode == "off" or budget == 1:
            return trie.flatten(0)
        n_retrieval = 0
        if mode in ("racer", "retrieval"):
            n_retrieval = add_retrieval(trie, self.automaton, root, cfg.min_depth, cfg.retrieval_min_prob)
            if self.view is not None and not trie.full():  # the shared prefix, after the session's own text
                n_retrieval += add_retrieval(trie, self.view, root, cfg.min_depth, cfg.retrieval_min_prob)
        fill = self._logits_fill(mode)
        if self.corpus is not None and mode == "racer" and not trie.full():
            # the tenant's evidence is the prior of the session's own (which it pools too)
            seen = (self.corpus.evidence.pair(), self.corpus_evidence.pair())
            found = corpus_candidates(
                self.corpus, self.history, root, budget - 1, cfg.corpus_min_match, seen, cfg.corpus_min_prob
            )
            if found:  # the corpus and the copy-logit tree compete for the places retrieval left
                merge_corpus(trie, found, fill, cfg.corpus_min_prob)
                fill = None
        if fill is not None:
            fill(trie)
        elif mode == "pld":
            self._add_prompt_lookup(trie, root)
        return trie.flatten(n_retrieval)

    def _logits_fill(self, mode: str):
        """The copy-logit expansion of ``mode`` as a function of the trie (None: the mode has none)."""
        if mode not in ("racer", "logits", "last-logit"):
            return None
        get = self.table.get
        if mode == "last-logit":
            last = self.last_topk
            get = lambda _tok: last  # noqa: E731
        if self.config.logits_tree == "halving":
            return lambda trie: add_logits(trie, get, self.config.topk)
        return lambda trie: add_logits_best_first(trie, get)

    def _add_prompt_lookup(self, trie: _Trie, root: int) -> None:
        """One chain copied after the most recent earlier occurrence of the longest matching n-gram."""
        hist = self.history
        for size in range(min(self.config.pld_ngram, len(hist) + 1), 0, -1):
            key = (*hist[len(hist) - size + 1 :], root) if size > 1 else (root,)
            ends = self._ngram_last.get(key)
            end = -1 if ends is None else ends[0] if ends[0] < len(hist) - 1 else ends[1]
            if end < 0 and self.prefix is not None:  # an occurrence in the shared prefix
                ends = self.prefix.ngram_last.get(key)
                end = -1 if ends is None else ends[0] if ends[0] < len(hist) - 1 else ends[1]
            if end < 0:
                continue
            node = 0
            for t in hist[end + 1 : end + trie.budget]:
                node = trie.add(node, t)
                if node < 0:
                    return
            if node != 0:
                return

    # -- introspection ----------------------------------------------------------------------------
    def memory_estimate(self) -> int:
        """Rough bytes held by this session (automaton lists and dicts, table rows, history)."""
        a = self.automaton
        total = sum(sys.getsizeof(d) for d in a.children)
        total += sum(sys.getsizeof(x) for x in (a.parent, a.token, a.depth, a.freq, a.fail, a.start))
        total += 28 * 6 * len(a.children)  # small ints are shared; count boxed slots roughly
        total += sys.getsizeof(self.table.rows) + sum(sys.getsizeof(r) for r in self.table.rows.values())
        total += sys.getsizeof(self.history) + sys.getsizeof(self._ngram_last) + 100 * len(self._ngram_last)
        return total
