"""The draft -> verify -> commit loop, readable top to bottom.

``Rounds`` is the round itself without I/O. ``generate`` drives it with one session's drafting and
verification through the two small protocols below, ``DraftPort`` and ``VerifyPort`` (the in-process
cores for ``racer generate`` and the benchmarks); the gateway's turn drives it over gRPC streams.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from .params import GenerationParams


class DraftPort(Protocol):
    """One session's drafting, as ``generate`` drives it (``drafter.draft_session.DraftSession``)."""

    def extend(self, tokens, topk_rows=None) -> None: ...
    def observe_tree(self, tree_tokens, tree_topk, accepted) -> None: ...
    def draft(self, root: int, budget: int, mode: str): ...  # -> .tokens, .parents
    def catch_up(self, tokens, topk_rows, mode: str) -> None: ...  # tokens verified without a tree


class VerifyPort(Protocol):
    """One session's verification, as ``generate`` drives it (``verifier.engine.VerifierSession``)."""

    length: int  # tokens in the KV cache

    def prefill(self, tokens: list[int], topk_rows: int | None = None): ...  # -> .next_token, .topk (last rows)
    def verify(self, tokens: list[int], parents: list[int]): ...  # -> .accepted, .bonus, .topk
    def truncate(self, length: int) -> None: ...


@dataclass
class Stats:
    new_tokens: int = 0
    rounds: int = 0  # verification forwards after prefill
    drafted: int = 0  # tree nodes beyond the root, summed over rounds
    accepted: int = 0  # accepted tree nodes beyond the root, summed over rounds
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafter update + draft, summed
    verify_s: float = 0.0
    total_s: float = 0.0
    draft_step_s: list[float] = field(default_factory=list)  # per round, for latency percentiles
    forwards: list[tuple[int, int, float]] = field(default_factory=list)  # per round: (nodes, cache tokens, ms)

    def forward(self, nodes: int, length: int, seconds: float) -> None:
        """One verification of ``nodes`` nodes over ``length`` cached tokens took ``seconds``."""
        self.verify_s += seconds
        self.forwards.append((nodes, length, seconds * 1e3))

    def count_round(self, tree_nodes: int, accepted_nodes: int) -> None:
        """One verification of ``tree_nodes`` nodes whose accepted path had ``accepted_nodes`` (root included)."""
        self.rounds += 1
        self.drafted += tree_nodes - 1
        self.accepted += accepted_nodes - 1

    @property
    def mat(self) -> float:
        """Mean accepted tokens per verification round, bonus included."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0


class Rounds:
    """The round's bookkeeping without I/O, for ``generate`` here and the gateway's turn over gRPC.

    Invariant between rounds: the verifier's cache and the drafter's context hold ``committed`` (the
    prompt and every emitted token but the last one) and ``root`` is that last token (chosen by the
    target, not yet fed). A round: draft a tree at ``root``, verify it, ``settle`` the result.
    """

    def __init__(self, prompt_ids: list[int], params: GenerationParams, stats: Stats | None = None):
        self.committed = list(prompt_ids)
        self.stop = set(params.stop_token_ids)
        self.max_new = params.max_new_tokens
        self.mode = params.mode
        self.budget = params.budget  # tree nodes per round; a driver may settle an adaptive 0 at open
        self.stats = stats if stats is not None else Stats()
        self.root: int | None = None

    def start(self, next_token: int) -> tuple[list[int], bool]:
        """After prefill: the first tokens to emit (``next_token``, unless there is no room) and whether to stop."""
        self.root = next_token
        return cut([next_token], self.stop, self.max_new)

    def emitted(self, tokens: list[int]) -> None:
        """``tokens`` went out (the gateway may emit fewer than ``settle`` offered: a stop string)."""
        self.stats.new_tokens += len(tokens)

    def check_tree(self, tree_tokens) -> bool:
        """Whether a drafted tree is rooted at ``root``: the verifier would otherwise check the wrong text."""
        return len(tree_tokens) > 0 and tree_tokens[0] == self.root

    def settle(self, tree_tokens, accepted, bonus: int) -> tuple[list[int], list[int], bool]:
        """After a verification (``accepted``: node indices, root first): the tokens to emit, the tokens
        to commit (the drafter and verifier drop the rest of the accepted path) and whether to stop."""
        path = [tree_tokens[i] for i in accepted]
        out, fed, done = settle(path, bonus, self.stop, self.max_new - self.stats.new_tokens)
        self.committed.extend(fed)
        self.root = out[-1] if out else bonus
        self.stats.count_round(len(tree_tokens), len(accepted))
        return out, fed, done


def generate(
    drafter: DraftPort,
    verifier: VerifyPort,
    prompt_ids: list[int],
    params: GenerationParams,
    stats: Stats | None = None,
    prompt_topk: int | None = None,
) -> Iterator[list[int]]:
    """Yields the new token ids as they are verified (a list per round). Fills ``stats``.
    ``prompt_topk``: the prompt positions, the last ones, whose top-k the drafter's copy-logit table
    gets (None: every position; an ``off`` turn, which drafts nothing, asks for none).

    With the adaptive budget, a drafter whose last choice was to rest (``rest``: rounds to verify
    without a tree, as the gateway does) is not asked again until those rounds are done; their
    tokens reach it in one ``catch_up``, as the gateway's next step carries them."""
    rounds = Rounds(prompt_ids, params, stats)
    stats = rounds.stats
    t0 = time.perf_counter()
    pre = verifier.prefill(prompt_ids, topk_rows=0 if rounds.mode == "off" else prompt_topk)
    stats.prefill_s = time.perf_counter() - t0
    t = time.perf_counter()
    drafter.extend(prompt_ids, pre.topk)
    stats.draft_s += time.perf_counter() - t
    out, done = rounds.start(pre.next_token)
    rest, plain, plain_topk = 0, [], []  # rounds left to verify without a tree, and what they committed
    while True:
        rounds.emitted(out)
        stats.total_s = time.perf_counter() - t0
        if out:
            yield out
        if done:
            return
        if rest:
            rest -= 1
            t, length = time.perf_counter(), verifier.length
            res = verifier.verify([rounds.root], [-1])
            stats.forward(1, length, time.perf_counter() - t)
            out, fed, done = rounds.settle([rounds.root], res.accepted, res.bonus)
            plain.extend(fed)
            plain_topk.extend(res.topk[: len(fed)])
            continue
        t = time.perf_counter()
        if plain:
            drafter.catch_up(plain, plain_topk, rounds.mode)
            plain, plain_topk = [], []
        tree = drafter.draft(rounds.root, rounds.budget, rounds.mode)
        rest = getattr(drafter, "rest", 0) if rounds.budget == 0 else 0
        t_draft = time.perf_counter() - t
        if not rounds.check_tree(tree.tokens):
            raise ValueError(f"drafter returned a tree rooted at {tree.tokens[:1]}, expected root {rounds.root}")
        t, length = time.perf_counter(), verifier.length
        res = verifier.verify(list(tree.tokens), list(tree.parents))
        stats.forward(len(tree.tokens), length, time.perf_counter() - t)
        out, fed, done = rounds.settle(tree.tokens, res.accepted, res.bonus)
        if len(fed) < len(res.accepted):  # the verifier cached the whole accepted path
            verifier.truncate(verifier.length - (len(res.accepted) - len(fed)))
        t = time.perf_counter()
        drafter.observe_tree(tree.tokens, res.topk, res.accepted)
        drafter.extend(fed)
        t_draft += time.perf_counter() - t
        stats.draft_s += t_draft
        stats.draft_step_s.append(t_draft)


def settle(path: list[int], bonus: int, stop: set[int], room: int) -> tuple[list[int], list[int], bool]:
    """After a verification: the tokens to emit, the tokens to commit, and whether to stop.

    ``path`` is the accepted path, root first; the emitted tokens are ``path[1:] + [bonus]`` up to
    the first stop token and at most ``room``. A cut round commits only what precedes its last
    emitted token, which keeps the invariant: committed = prompt + emitted, minus the last.
    """
    out, done = cut(path[1:] + [bonus], stop, room)
    return out, path[: len(out)], done


def cut(tokens: list[int], stop: set[int], room: int) -> tuple[list[int], bool]:
    """Tokens to emit (through the first stop token, at most ``room``) and whether to stop."""
    out = []
    for tok in tokens:
        if len(out) >= room:
            return out, True
        out.append(tok)
        if tok in stop:
            return out, True
    return out, len(out) >= room
