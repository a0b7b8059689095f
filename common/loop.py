"""The draft -> verify -> commit loop, readable top to bottom.

``generate`` drives any drafter and verifier that speak the small protocols below: the in-process
cores for ``racer generate`` and the benchmark, gRPC clients in the services.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from .params import GenerationParams


class Drafter(Protocol):
    def extend(self, tokens, topk_rows=None) -> None: ...
    def observe_tree(self, tree_tokens, tree_topk, accepted) -> None: ...
    def draft(self, root: int, budget: int, mode: str): ...  # -> .tokens, .parents


class Verifier(Protocol):
    length: int  # tokens in the KV cache

    def prefill(self, tokens: list[int]): ...  # -> .next_token, .topk
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


def generate(
    drafter: Drafter, verifier: Verifier, prompt_ids: list[int], params: GenerationParams, stats: Stats | None = None
) -> Iterator[list[int]]:
    """Yields the new token ids as they are verified (a list per round). Fills ``stats``."""
    stats = stats if stats is not None else Stats()
    stop = set(params.stop_token_ids)
    t0 = time.perf_counter()
    pre = verifier.prefill(prompt_ids)
    stats.prefill_s = time.perf_counter() - t0
    t = time.perf_counter()
    drafter.extend(prompt_ids, pre.topk)
    stats.draft_s += time.perf_counter() - t
    root = pre.next_token
    out, done = cut([root], stop, params.max_new_tokens)
    # Invariant between rounds: the verifier's cache and the drafter's context hold the prompt and
    # every emitted token but the last one (``root``: chosen by the target, not yet fed).
    while True:
        stats.new_tokens += len(out)
        stats.total_s = time.perf_counter() - t0
        if out:
            yield out
        if done:
            return
        t = time.perf_counter()
        tree = drafter.draft(root, params.budget, params.mode)
        t_draft = time.perf_counter() - t
        if not tree.tokens or tree.tokens[0] != root:
            raise ValueError(f"drafter returned a tree rooted at {tree.tokens[:1]}, expected root {root}")
        t = time.perf_counter()
        res = verifier.verify(list(tree.tokens), list(tree.parents))
        stats.verify_s += time.perf_counter() - t
        path = [tree.tokens[i] for i in res.accepted]  # root first
        out, fed, done = settle(path, res.bonus, stop, params.max_new_tokens - stats.new_tokens)
        if len(fed) < len(path):
            verifier.truncate(verifier.length - (len(path) - len(fed)))
        t = time.perf_counter()
        drafter.observe_tree(tree.tokens, res.topk, res.accepted)
        drafter.extend(fed)
        t_draft += time.perf_counter() - t
        stats.draft_s += t_draft
        stats.draft_step_s.append(t_draft)
        stats.count_round(len(tree.tokens), len(res.accepted))
        root = out[-1] if out else res.bonus


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
