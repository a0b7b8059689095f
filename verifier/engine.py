"""One session of the target model: prefill, tree verification, KV bookkeeping; and which backend
runs it (``make_backend``)."""

from __future__ import annotations

import os
import random
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from common import settings
from common.costs import ContextSlope, slope_from
from common.params import SamplingParams
from common.settings import BACKENDS, OLD_BACKENDS

from . import native
from .acceptance import accept
from .backend import Backend
from .constraints import Adjust, LogProbs, logprobs, masked
from .hf import HFBackend, chain_of
from .llama import LlamaBackend, forward_segments
from .sampling import Sampler
from .tree import tree_inputs, validate

TOPK = settings.default("verifier", "--topk")  # next-token ids sent back per position (the table's default)
_PREFILL_CHUNK = 256  # rows of the output projection computed at once (bounds [chunk, V] logits)


@dataclass
class PrefillResult:
    next_token: int  # the target's choice after the last prompt token
    # [rows, k]: top-k next-token ids at the prompt's last ``rows`` positions (every position unless
    # the prefill asked for fewer: ``topk_rows``)
    topk: list[list[int]]
    logprobs: LogProbs | None = None  # of next_token, when the session asks for them


@dataclass
class VerifyResult:
    accepted: list[int]  # accepted node indices, root first
    bonus: int  # the target's choice after the last accepted node
    topk: list[list[int]]  # [n_nodes, k]: top-k next-token ids at every tree node
    logprobs: LogProbs | None = None  # of each accepted node's successor, then the bonus


def backend_for(model, kind: str = "auto") -> str:
    """The backend ``make_backend(model, kind)`` builds: "llama" or "hf". ``auto``: "llama" where it
    implements the model (``LlamaBackend.supports``), else "hf"; ``llama``: the llama one or
    ValueError; ``hf``: the hf one, float32 only (ValueError for another dtype). An old name warns.
    Decided without building it: the verifier checks at start-up what its sessions will build."""
    new = dict(OLD_BACKENDS).get(kind)
    if new is not None:
        warnings.warn(f"backend {kind!r} is now called {new!r}", DeprecationWarning, stacklevel=3)
        kind = new
    if kind not in BACKENDS:
        raise ValueError(f"unknown backend {kind!r} (one of {', '.join(BACKENDS)})")
    if kind == "auto":
        kind = "llama" if LlamaBackend.supports(model) else "hf"
    if kind == "llama":
        if not LlamaBackend.supports(model):
            why = LlamaBackend.unsupported(model)
            raise ValueError(f"the llama backend does not support model_type={model.config.model_type!r}: {why}")
        return kind
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        # Its rows' bits depend on what shares a forward (tree nodes, other sessions), so drafts
        # could change a reduced-precision output: only the llama forward is batch invariant.
        raise ValueError(
            f"model_type={model.config.model_type!r} runs on the hf backend, which verifies in float32 "
            f"only (got {str(dtype).replace('torch.', '')}): use --dtype float32"
        )
    return kind


def make_backend(model, kind: str = "auto", capacity: int = 1024) -> Backend:
    """The backend ``backend_for(model, kind)`` names (ValueError where it refuses). ``capacity``: rows
    the llama backend allocates now."""
    if backend_for(model, kind) == "llama":
        return LlamaBackend(model, capacity)
    return HFBackend(model)


class VerifierSession:
    """Holds one sequence's KV cache. ``length`` tokens are committed; the next input continues them."""

    def __init__(
        self,
        model,
        topk: int = TOPK,
        backend: str = "auto",
        sampling: SamplingParams = SamplingParams(),
        capacity: int = 1024,
    ):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.topk = topk
        self.backend = make_backend(model, backend, capacity)
        self.cuts = 0  # truncations that dropped committed rows: a copy of rows checks none came between
        self.set_sampling(sampling)
        self.logprobs = -1  # log-probabilities of chosen tokens: -1 none, 0 the chosen one, n: and the top n
        self.open_mask: torch.Tensor | None = None  # bool [V]: allowed after the prompt (its next choice)
        self.masks: torch.Tensor | None = None  # bool [nodes, V]: allowed after each node of the next tree
        self.adjust: Adjust | None = None  # logit_bias and penalties of the turn (None: none)
        self.generated: list[int] = []  # the turn's tokens in the cache (penalties count them)
        # echo: prefills record each prompt token's log-probability given the ones before it
        self.echo = False
        self.echo_tokens: list[int] = []  # the prompt being prefilled
        self.echo_out: list[tuple[float | None, list[int], list[float]]] = []  # per prefilled token
        self._echo_prev: torch.Tensor | None = None  # log-probabilities after the last prefilled token

    def set_sampling(self, sampling: SamplingParams) -> None:
        self.sampling = sampling
        self._sampler = None if sampling.greedy else Sampler(sampling)

    @property
    def length(self) -> int:
        return self.backend.length

    def truncate(self, length: int) -> None:
        if length < self.backend.length:
            self.cuts += 1
        self.backend.truncate(length)

    @property
    def prefix_exact(self) -> bool:
        """Rows from the prefix cache may be copied in (``read_rows`` / ``write_rows``)."""
        return self.backend.prefix_exact

    def read_rows(self, start: int, end: int):
        return self.backend.read_rows(start, end)

    def write_rows(self, rows, skip: int = 0) -> None:
        self.backend.write_rows(rows, skip)

    def rows_needed(self, n: int) -> int:
        """Cache rows a forward of ``n`` new tokens needs (KV memory reserves them beforehand)."""
        return self.length + n + self.backend.pad_rows()

    def set_reserved_rows(self, rows: int) -> None:
        """The rows KV memory holds for this cache: a growing cache grows to them at once."""
        self.backend.reserved_rows = rows

    def resize(self, rows: int) -> None:
        """Gives back (or allocates) cache rows: exactly ``max(rows, length)`` afterwards. A cache
        that only ever holds its committed rows (the hf backend's) has nothing to do."""
        self.backend.resize(rows)

    def _choose(self, logits_row: torch.Tensor) -> int:
        if self._sampler is None:
            return int(torch.argmax(logits_row))
        return self._sampler(logits_row.cpu())

    @torch.inference_mode()
    def prefill(self, tokens: list[int], choose: bool = True, topk_rows: int | None = None) -> PrefillResult:
        """Appends ``tokens`` to the cache (a first prompt, or a later turn's new tokens).
        ``choose=False`` (a chunk before the last of a long prompt): ``next_token`` is -1 and a
        sampler draws nothing, so a chunked prefill draws what an unchunked one does. ``topk_rows``:
        the top-k of only the last that many positions (None: all); the output layer runs over the
        rows it needs only (those, and the last row when ``choose``)."""
        inputs = self._prefill_inputs(tokens)
        self.echo_tokens = list(tokens) if self.echo else []
        # A prompt is one fused forward even in invariant mode: every run of the same prompt gets the
        # same bits; only tree rows must match what a one-token step computes.
        exact = {"rows_exact": False} if self.backend.invariant else {}
        hidden = self.backend.forward(*inputs, **exact)
        self.backend.commit(None, hidden.shape[0])
        return _prefilled([(self, hidden, choose, topk_rows, None)])[0]

    def _prefill_inputs(self, tokens: list[int]):
        """(ids [n], positions [n], causal mask [n, length + n] or None) of a prompt continuing the cache."""
        if not tokens:
            raise ValueError("prefill: no tokens")
        validate(tokens, [-1, *range(len(tokens) - 1)], self.vocab_size)
        past = self.length
        n = len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long)
        positions = torch.arange(past, past + n)
        mask = None
        if n > 1:
            mask = torch.ones((n, past + n), dtype=torch.bool)
            mask[:, past:] = torch.ones((n, n), dtype=torch.bool).tril()
        return ids, positions, mask

    @torch.inference_mode()
    def verify(self, tokens: list[int], parents: list[int]) -> VerifyResult:
        """One forward over the whole tree; keeps the accepted path's K/V rows only."""
        if self.backend.chain_only:
            return self._verify_chain(tokens, parents)
        ids, positions, mask = self._inputs(tokens, parents)
        hidden = self.backend.forward(ids, positions, mask)
        if self._path_head(tokens, parents):
            lazy = _PathHead(self, tokens, parents, hidden)
            _settle_paths([lazy], self.backend.logits)
            return lazy.result()
        return self._settle(tokens, parents, self.backend.logits(hidden))

    def _path_head(self, tokens: list[int], parents: list[int]) -> bool:
        """Whether this tree's output layer runs on the rows acceptance reads only (``_PathHead``):
        greedy, without logit adjustments or grammar masks, a tree with more nodes than its first path,
        on an output layer whose rows' bits do not depend on the rows beside them."""
        return (
            _PATH_HEAD
            and self._sampler is None
            and self.adjust is None
            and self.masks is None
            and getattr(self.backend, "head_rows_exact", False)
            and len(chain_of(parents)) < len(tokens)
        )

    def _take_masks(self, rows: list[int] | None = None) -> torch.Tensor | None:
        """The next tree's masks (used once), of ``rows`` only if given."""
        masks, self.masks = self.masks, None
        return masks if masks is None or rows is None else masks[rows]

    def _verify_chain(self, tokens: list[int], parents: list[int]) -> VerifyResult:
        """For a model that cannot verify trees: the tree's first path, verified as a chain.

        The nodes off that path are not evaluated; their top-k rows (for the drafter's copy-logit
        table, which never affects the output) are those of an evaluated node with the same token,
        else of their nearest evaluated ancestor."""
        validate(tokens, parents, self.vocab_size)
        chain = chain_of(parents)
        self.masks = self._take_masks(chain)
        sub = self._settle(
            [tokens[i] for i in chain],
            [-1, *range(len(chain) - 1)],
            self.backend.logits(self.backend.forward(*self._inputs_chain(tokens, chain))),
        )
        on = {node: row for node, row in zip(chain, sub.topk)}
        by_token = {tokens[node]: row for node, row in on.items()}
        topk = []
        for i in range(len(tokens)):
            a = i
            while a not in on:
                a = parents[a]
            topk.append(on[i] if i in on else by_token.get(tokens[i], on[a]))
        return VerifyResult([chain[j] for j in sub.accepted], sub.bonus, topk, sub.logprobs)

    def _inputs_chain(self, tokens: list[int], chain: list[int]):
        n = len(chain)
        positions, mask = tree_inputs([-1, *range(n - 1)], self.length)
        return torch.tensor([tokens[i] for i in chain], dtype=torch.long), positions, mask

    def _inputs(self, tokens: list[int], parents: list[int]):
        validate(tokens, parents, self.vocab_size)
        positions, mask = tree_inputs(parents, self.length)
        return torch.tensor(tokens, dtype=torch.long), positions, mask

    def _settle(self, tokens: list[int], parents: list[int], logits: torch.Tensor) -> VerifyResult:
        """Top-k, acceptance and KV commit from the tree's logits [n, V]; each node's choice among the
        tokens its mask allows (its own path's grammar state)."""
        raw = logits
        if self.adjust is not None:
            logits = self.adjust.apply(logits, _contexts(self.generated, tokens, parents))
        logits = masked(logits, self._take_masks())
        topk, argmax = _top(logits, self.topk, self._sampler is None)
        if argmax is not None:
            path, bonus = accept(tokens, parents, argmax.__getitem__)
        else:
            path, bonus = accept(tokens, parents, lambda i: self._sampler(logits[i].cpu()))
        self.backend.commit(path, len(tokens))
        if self.adjust is not None:
            self.generated.extend(tokens[i] for i in path)
        lp = None
        if self.logprobs >= 0:  # the token chosen at each accepted node: the next one on the path, then the bonus
            lp = logprobs(raw[path], [tokens[i] for i in path[1:]] + [bonus], self.logprobs)
        return VerifyResult(path, bonus, topk, lp)


def _top(logits: torch.Tensor, k: int, argmax: bool = False) -> tuple[list[list[int]], list[int] | None]:
    """Each row's ``k`` best ids of ``logits`` [n, V], best first, and with ``argmax`` each row's
    argmax (None without): one native pass where it applies (``native.top_rows``: ties by position,
    so its first id is ``torch.argmax``'s), else torch's top-k and argmax."""
    ids = native.top_rows(logits, max(k, 1))
    if ids is not None:
        return ids[:, :k].tolist(), ids[:, 0].tolist() if argmax else None
    top = torch.topk(logits, k, dim=-1).indices.tolist()
    return top, torch.argmax(logits, dim=-1).tolist() if argmax else None


def _echo_rows(items, spans) -> dict[int, list[tuple["VerifierSession", int]]]:
    """Head rows -> (echoing session, the row's position in its prompt)."""
    rows: dict[int, list] = {}
    for (session, *_), (pieces, _, _) in zip(items, spans):
        if session.echo:
            k = 0
            for first, count in pieces:
                for r in range(first, first + count):
                    rows.setdefault(r, []).append((session, k))
                    k += 1
    return rows


def _echo(rows: dict[int, list], logits: torch.Tensor, start: int) -> None:
    """Each echoing session's prompt tokens' log-probabilities from the head rows ``start`` on
    (``logits`` [rows, V]): row k gives token k + 1; a prompt's last row is kept for the first
    token of its next chunk, and its first token takes the last row of the chunk before (or None)."""
    for i in range(logits.shape[0]):
        for session, k in rows.get(start + i, ()):
            lp = torch.log_softmax(logits[i].float(), -1)
            toks = session.echo_tokens
            if k == 0:
                prev, session._echo_prev = session._echo_prev, None
                session.echo_out.append(_echo_entry(prev, toks[0], session.logprobs))
            if k + 1 < len(toks):
                session.echo_out.append(_echo_entry(lp, toks[k + 1], session.logprobs))
            else:
                session._echo_prev = lp


def _echo_entry(lp: torch.Tensor | None, token: int, n: int) -> tuple[float | None, list[int], list[float]]:
    if lp is None:
        return None, [], []
    if n <= 0:
        return float(lp[token]), [], []
    top = torch.topk(lp, n)
    return float(lp[token]), top.indices.tolist(), top.values.tolist()


def _contexts(generated: list[int], tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Per node: the turn's tokens before its choice (those cached, then its own path, root first)."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else generated) + [tokens[i]])
    return paths


@torch.inference_mode()
def verify_batch(items: list[tuple["VerifierSession", list[int], list[int]]]) -> list[VerifyResult | ValueError]:
    """Verifies several sessions' trees; those on the llama backend of one model share one forward.

    Each result is what ``session.verify(tokens, parents)`` alone returns (an invalid tree gets its
    ValueError and leaves its session untouched; the others go on).
    """
    results: list = [None] * len(items)
    batch = []
    for j, (session, tokens, parents) in enumerate(items):
        try:
            inputs = session._inputs(tokens, parents)
        except ValueError as e:
            results[j] = e
            continue
        if isinstance(session.backend, LlamaBackend):
            batch.append((j, inputs))
        else:
            results[j] = session.verify(tokens, parents)
    groups: dict[int, list] = {}
    for j, inputs in batch:
        groups.setdefault(id(items[j][0].model), []).append((j, inputs))
    for group in groups.values():
        hidden = forward_segments([(items[j][0].backend, *inputs) for j, inputs in group])
        head = items[group[0][0]][0].backend.logits
        lazy = {j: _PathHead(*items[j], h) for (j, _), h in zip(group, hidden) if items[j][0]._path_head(*items[j][1:])}
        _settle_paths(list(lazy.values()), head)
        rest = [(j, h) for (j, _), h in zip(group, hidden) if j not in lazy]
        logits = head(torch.cat([h for _, h in rest])) if len(rest) > 1 else head(rest[0][1]) if rest else None
        start = 0
        for j, h in rest:
            session, tokens, parents = items[j]
            results[j] = session._settle(tokens, parents, logits[start : start + h.shape[0]])
            start += h.shape[0]
        for j, it in lazy.items():
            results[j] = it.result()
    return results


# The output layer of a greedy tree over the rows acceptance reads only (``_PathHead``); "all" in
# RACER_HEAD_ROWS runs it over every node, as a tree without that condition always does.
_PATH_HEAD = os.environ.get("RACER_HEAD_ROWS", "path") != "all"


class _Need(Exception):
    """Acceptance reached a node whose output-layer row is not computed yet."""

    def __init__(self, node: int):
        super().__init__(node)
        self.node = node


class _PathHead:
    """A greedy tree's acceptance with the output layer run on the rows it reads.

    Acceptance reads one node's logits per accepted node: the root's argmax picks the child to go
    to, and so on until no child matches (the bonus). The output layer runs first over the tree's
    first path (the drafter puts its likeliest continuation first), then, where acceptance leaves
    that path, over the first path from the node it reached, until it ends: a 49,152-token layer is a
    quarter of a 16-node tree's step on the default model, and a 262k-token one most of it. Each row
    is what the layer over every node gives (its rows' bits do not depend on the others: the block
    kernel, or an invariant plan's), so the accepted path, the bonus and their log-probabilities are
    the same. A node not computed gets the top-k row of a computed node with its token, else of its
    nearest computed ancestor (the drafter's copy-logit table; it never changes the output)."""

    def __init__(self, session: "VerifierSession", tokens: list[int], parents: list[int], hidden: torch.Tensor):
        self.session, self.tokens, self.parents, self.hidden = session, tokens, parents, hidden
        self.rows: dict[int, torch.Tensor] = {}  # node -> its logits row
        self.top: dict[int, list[int]] = {}
        self.choice: dict[int, int] = {}
        self.need = chain_of(parents)  # the rows the next run of the layer computes
        self.done: tuple[list[int], int] | None = None

    def _choose(self, node: int) -> int:
        if node not in self.choice:
            raise _Need(node)
        return self.choice[node]

    def take(self, logits: torch.Tensor) -> None:
        """The layer's rows for ``need``, in order: acceptance goes on as far as they reach."""
        topk, argmax = _top(logits, self.session.topk, True)
        for node, row, top, best in zip(self.need, logits, topk, argmax):
            self.rows[node], self.top[node], self.choice[node] = row, top, best
        try:
            self.done, self.need = accept(self.tokens, self.parents, self._choose), []
        except _Need as e:
            self.need = [n for n in chain_of(self.parents, e.node) if n not in self.rows]

    def result(self) -> VerifyResult:
        path, bonus = self.done
        s, tokens = self.session, self.tokens
        s.backend.commit(path, len(tokens))
        by_token = {tokens[node]: top for node, top in self.top.items()}
        topk = []
        for i in range(len(tokens)):
            a = i
            while a not in self.top:
                a = self.parents[a]
            topk.append(self.top[i] if i in self.top else by_token.get(tokens[i], self.top[a]))
        lp = None
        if s.logprobs >= 0:
            chosen = [tokens[i] for i in path[1:]] + [bonus]
            lp = logprobs(torch.stack([self.rows[i] for i in path]), chosen, s.logprobs)
        return VerifyResult(path, bonus, topk, lp)


def _settle_paths(items: list[_PathHead], head) -> None:
    """Runs ``head`` (the output layer) over what the trees' acceptances read, every tree's rows of a
    round in one call, until each tree's acceptance is done."""
    while pending := [it for it in items if it.need]:
        parts = [it.hidden[it.need] for it in pending]
        logits = head(torch.cat(parts) if len(parts) > 1 else parts[0])
        start = 0
        for it in pending:
            n = len(it.need)
            it.take(logits[start : start + n])
            start += n


def _logit_rows(n: int, choose: bool, topk_rows: int | None) -> tuple[int, int]:
    """Of an ``n``-row prompt: (its last rows the output layer runs over, how many of them get top-k):
    the last ``topk_rows`` (None: all), and the last row when ``choose`` (its logits pick the token)."""
    top = n if topk_rows is None else min(n, max(0, topk_rows))
    return max(top, 1 if choose else 0), top


def _head_input(items) -> tuple[list[torch.Tensor], list[tuple[list[tuple[int, int]], int, int | None]]]:
    """The rows ``_prefilled``'s items need through the output layer (``_logit_rows``), as parts of
    its input, and per item: its rows there as (first, count) pieces in order, how many of them get
    top-k, and its last one (None: no rows). A shared prefix's rows are one part for all of its
    items, sliced from the earliest row any of them needs, so none goes through the layer twice."""
    wants = [  # an echoing session needs every row: each one's log-probabilities of the next prompt token
        _logit_rows(
            (0 if prefix is None else prefix.shape[0]) + hidden.shape[0], choose, None if session.echo else topk_rows
        )
        for session, hidden, choose, topk_rows, prefix in items
    ]
    earliest: dict[int, int] = {}  # id(prefix) -> its first row any item needs
    for (_, hidden, _, _, prefix), (rows, _) in zip(items, wants):
        if rows > hidden.shape[0]:
            start = prefix.shape[0] + hidden.shape[0] - rows
            earliest[id(prefix)] = min(start, earliest.get(id(prefix), start))
    parts: list[torch.Tensor] = []
    placed: dict[tuple, int] = {}  # a part's key -> its first row in the head's input

    def place(key: tuple, rows: torch.Tensor) -> int:
        if key not in placed:
            placed[key] = sum(part.shape[0] for part in parts)
            parts.append(rows)
        return placed[key]

    spans = []
    for j, ((_, hidden, _, _, prefix), (rows, top)) in enumerate(zip(items, wants)):
        own = hidden.shape[0]
        mine, pieces = min(rows, own), []
        if rows > own:  # reaches into the shared prefix: its last rows - own rows
            first = earliest[id(prefix)]
            base = place(("prefix", id(prefix)), prefix[first:])
            pieces.append((base + prefix.shape[0] - (rows - own) - first, rows - own))
        if mine:
            pieces.append((place(("own", j), hidden[own - mine :]), mine))
        spans.append((pieces, top, pieces[-1][0] + pieces[-1][1] - 1 if pieces else None))
    return parts, spans


def _prefilled(items) -> list[PrefillResult]:
    """Each prompt's result from its committed rows' hidden states (``(session, hidden [n, hidden],
    choose, topk_rows, prefix)``, sessions of one model and one top-k width; ``prefix``: None, or the
    hidden states [p, hidden] of rows before ``hidden`` that other prompts share, the same tensor for
    them all). The output layer runs once over every row that needs it (``_head_input``), in chunks
    of ``_PREFILL_CHUNK`` rows, so the head's weights are read once per chunk, not once per prompt.
    Logits are rowwise: in reduced precision (row-invariant kernels) a row's bits do not depend on
    the other rows of the call; in float32 a larger call may pick another kernel (~1e-7), as tree
    batches may."""
    parts, spans = _head_input(items)
    session0 = items[0][0]
    topk: list[list[int]] = []
    last: dict[int, torch.Tensor] = {}  # row -> its logits, for the prompts' last rows
    ends = {end for _, _, end in spans if end is not None}
    echo = _echo_rows(items, spans)
    if parts:
        hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
        for s in range(0, hidden.shape[0], _PREFILL_CHUNK):
            logits = session0.backend.logits(hidden[s : s + _PREFILL_CHUNK])
            topk.extend(_top(logits, session0.topk)[0])
            last.update((r, logits[r - s]) for r in ends if s <= r < s + logits.shape[0])
            _echo(echo, logits, s)
    out = []
    for (session, hidden, choose, topk_rows, prefix), (pieces, top, end) in zip(items, spans):
        rows = [row for first, count in pieces for row in topk[first : first + count]]
        if session.echo:  # the top-k rows the caller asked for (the head ran over every row)
            top = _logit_rows((0 if prefix is None else prefix.shape[0]) + hidden.shape[0], choose, topk_rows)[1]
        nxt, lp = -1, None
        if choose:
            allowed, session.open_mask = session.open_mask, None
            row = last[end]
            if session.adjust is not None:
                row = session.adjust.apply(row[None], [session.generated])[0]
            nxt = session._choose(masked(row, allowed))
            if session.logprobs >= 0:
                lp = logprobs(last[end][None], [nxt], session.logprobs)
        out.append(PrefillResult(nxt, rows[len(rows) - top :], lp))
    return out


@torch.inference_mode()
def prefill_batch(
    items: list[tuple["VerifierSession", list[int], bool, int | None]],
) -> list[PrefillResult | BaseException]:
    """Prefills several sessions' prompts (``(session, tokens, choose, topk_rows)``); those on the llama
    backend of one model share one pass over the weights (``forward_segments``), each with its own
    positions, causal mask and cache, as tree batches do, and one output layer over the rows that
    need it (``_prefilled``).

    Each result is what ``session.prefill(tokens, choose, topk_rows)`` alone returns: attention runs
    per session; in invariant mode (reduced precision) the projections' and the output layer's rows
    are bit-identical whatever shares the call, as the prompt's attention is one fused call over the
    session's own rows, as alone. In float32 a larger call may pick another kernel, as tree batches
    may: ~1e-7, not batch invariant, as float32 is allowed to be (its contract is token identity
    with Hugging Face greedy). An invalid prompt gets its error and leaves its session untouched;
    the others go on.
    """
    results: list = [None] * len(items)
    groups: dict[tuple[int, int], list] = {}
    for j, (session, tokens, choose, topk_rows) in enumerate(items):
        if not isinstance(session.backend, LlamaBackend):
            try:
                results[j] = session.prefill(tokens, choose, topk_rows)
            except Exception as e:  # noqa: BLE001 - this prompt's caller gets it
                results[j] = e
            continue
        try:
            inputs = session._prefill_inputs(tokens)
        except ValueError as e:
            results[j] = e
            continue
        session.echo_tokens = list(tokens) if session.echo else []
        groups.setdefault((id(session.model), session.topk), []).append((j, inputs))
    for group in groups.values():
        heads = {} if items[group[0][0]][0].backend.invariant else _share_prefixes(group, items)
        group = [
            (j, items[j][0]._prefill_inputs(items[j][1][heads[j].shape[0] :])) if j in heads else (j, inputs)
            for j, inputs in group
        ]
        hidden = forward_segments([(items[j][0].backend, *inputs) for j, inputs in group], rows_exact=False)
        for (j, _), h in zip(group, hidden):
            items[j][0].backend.commit(None, h.shape[0])
        done = _prefilled([(items[j][0], h, *items[j][2:], heads.get(j)) for (j, _), h in zip(group, hidden)])
        for (j, _), res in zip(group, done):
            results[j] = res
    return results


# Fresh prompts of one batch (empty caches) that begin with at least this many equal tokens (a chat
# template's system prompt) compute those rows once: float32 only, where a row's bits may depend
# on the call; in reduced precision a prompt's rows never depend on what shares its batch.
SHARED_PREFIX = 16


def _prefix_sets(group, items) -> list[tuple[int, list[int]]]:
    """(length, item indices) of the group's fresh prompts that begin with the same at least
    ``SHARED_PREFIX`` tokens, two or more to a set; each keeps at least its last token to itself."""
    sets: dict[tuple[int, ...], list[int]] = {}
    for j, _ in group:
        session, tokens = items[j][0], items[j][1]
        if session.length == 0 and len(tokens) > SHARED_PREFIX:
            sets.setdefault(tuple(tokens[:SHARED_PREFIX]), []).append(j)
    out = []
    for members in sets.values():
        if len(members) < 2:
            continue
        prompts = [items[j][1] for j in members]
        end, length = min(len(p) for p in prompts) - 1, SHARED_PREFIX
        while length < end and all(p[length] == prompts[0][length] for p in prompts):
            length += 1
        out.append((length, members))
    return out


def _share_prefixes(group, items) -> dict[int, torch.Tensor]:
    """Prefills each set of prompts' common prefix (``_prefix_sets``) once, in one forward for all
    sets, into the first member's cache, and gives the other members those rows; a member then
    prefills only the rest of its prompt, as a chunked prefill would. Returns item index -> the
    prefix rows' hidden states (for its output layer)."""
    sets = _prefix_sets(group, items)
    if not sets:
        return {}
    segments = [(items[m[0]][0].backend, *items[m[0]][0]._prefill_inputs(items[m[0]][1][:n])) for n, m in sets]
    heads = {}
    for (n, members), hidden in zip(sets, forward_segments(segments, rows_exact=False)):
        first = items[members[0]][0].backend
        first.commit(None, n)
        for j in members:
            if j != members[0]:
                items[j][0].backend.take_prefix(first, n)
            heads[j] = hidden
    return heads


COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# The two cache lengths the curve is measured over: the curve itself at the first, its slope against
# the context (``common.costs.ContextSlope``) from the second, at a few sizes (linear between them).
COST_CONTEXTS = (256, 1280)
SLOPE_SIZES = (1, 4, 16, 64)


def measure_cost(
    model, sizes=COST_SIZES, context: int = 256, reps: int = 5, backend: str = "auto", topk: int = TOPK
) -> dict[int, float]:
    """Median milliseconds of one verification (forward, logits, top-k, acceptance) by tree size,
    over a ``context``-token cache: the curve the adaptive budget weighs acceptance against."""
    return _measure_curves(model, [(context, sizes)], reps, backend, topk)[0]


def measure_cost_slope(
    model, sizes=COST_SIZES, contexts=COST_CONTEXTS, reps: int = 5, backend: str = "auto", topk: int = TOPK
) -> tuple[dict[int, float], ContextSlope | None]:
    """``measure_cost``'s curve at ``contexts[0]`` tokens, and what each token of context adds to it,
    from the ``SLOPE_SIZES`` among ``sizes`` at ``contexts[1]`` (measured side by side). The second
    length is cut to what the model's positions hold; None where that leaves none longer than the
    first."""
    short, long = contexts
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None:
        long = min(long, limit - max(sizes) - 1)
    few = [n for n in sizes if n in SLOPE_SIZES] or [min(sizes), max(sizes)]
    if long <= short:
        return measure_cost(model, sizes, short, reps, backend, topk), None
    curves = _measure_curves(model, [(short, sizes), (long, few)], reps, backend, topk)
    return curves[0], slope_from(curves[0], curves[1], short, long)


def _measure_curves(model, plan, reps: int, backend: str, topk: int) -> list[dict[int, float]]:
    """Per ``(context, sizes)`` of ``plan``: the median ms of a verification by size over a cache of
    that many tokens."""
    rng = random.Random(0)
    vocab = model.config.vocab_size
    largest = max(n for _, sizes in plan for n in sizes)
    sessions = []
    for context, _ in plan:
        session = VerifierSession(model, topk, backend, capacity=context + largest + 1)
        if not sessions:
            session.prefill([rng.randrange(vocab) for _ in range(context)])
        while session.length < context:  # a longer cache: the first one's rows again (what they hold
            # changes no cost), where prefilling 1,280 tokens took the default model 2.7 s at start-up
            first = sessions[0]
            session.write_rows(first.read_rows(0, min(first.length, context - session.length)))
        sessions.append(session)
    trees = {n: ([rng.randrange(vocab) for _ in range(n)], [-1, *range(n - 1)]) for _, sizes in plan for n in sizes}
    times: list[dict[int, list[float]]] = [{n: [] for n in sizes} for _, sizes in plan]
    step = ([rng.randrange(vocab)], [-1])
    # Sizes (and contexts) interleaved within each repetition: on a shared machine the speed drifts,
    # and measuring one size after another would turn that drift into differences between sizes,
    # which is all the budget choice looks at. The first pass pays for kernel selection and is not
    # counted. Each timed verification follows a one-token step, as a round follows the last one in
    # a decoding loop: timed right after a 64-node tree, a one-token step of the default model took
    # 5.2 ms against 4.6 back to back (and 4.6 after the tree and an untimed step), so the curve
    # priced a 4-node tree at 1.2x a step where decoding paid 1.5x.
    for rep in range(reps + 1):
        for n in sorted(trees):
            for session, (context, _), out in zip(sessions, plan, times):
                if n not in out:
                    continue
                session.verify(*step)
                session.truncate(context)
                t0 = time.perf_counter()
                session.verify(*trees[n])
                if rep:
                    out[n].append((time.perf_counter() - t0) * 1e3)
                session.truncate(context)
    return [{n: statistics.median(ts) for n, ts in out.items()} for out in times]


def measure_prompt_rows(
    model, step_ms: float, rows: int = 64, reps: int = 5, backend: str = "auto", topk: int = TOPK
) -> int | None:
    """How many prompt rows' top-k cost at most ``step_ms`` (a one-token step): what a prefill of
    ``rows`` tokens takes with every row's top-k beyond what it takes with the last row only (the
    output layer and a top-k over each extra row), medians of ``reps``, the two interleaved. Those
    rows feed the drafter's copy-logit table; bounded so, they cost a turn at most one step's time.
    None: the rows cost nothing measurable (no bound)."""
    rng = random.Random(0)
    tokens = [rng.randrange(model.config.vocab_size) for _ in range(rows)]
    times: dict[int, list[float]] = {rows: [], 0: []}
    for rep in range(reps + 1):  # the first pass warms up and is not counted
        for asked in (rows, 0):
            session = VerifierSession(model, topk, backend)
            t0 = time.perf_counter()
            session.prefill(tokens, topk_rows=asked)
            if rep:
                times[asked].append((time.perf_counter() - t0) * 1e3)
    per_row = (statistics.median(times[rows]) - statistics.median(times[0])) / (rows - 1)
    return None if per_row <= 0 else int(step_ms / per_row)
