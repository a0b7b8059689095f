"""Tree attention is exact: one forward over a draft tree gives every node the logits that sequential
decoding of its root path gives, on both backends, and after ``verify`` the KV cache holds exactly
context + accepted path.
"""

from __future__ import annotations

import random

import pytest
import torch

from verifier.engine import VerifierSession
from verifier.hf import HFBackend
from verifier.llama import LlamaBackend
from verifier.tree import tree_inputs

BACKENDS = ["llama", "hf"]
ATOL = 1e-4


# -- helpers -------------------------------------------------------------------------------------------


def random_tree(rng: random.Random, n: int, vocab: int, shape: str) -> tuple[list[int], list[int]]:
    if shape == "chain":
        parents = [-1, *range(n - 1)]
    elif shape == "star":
        parents = [-1] + [0] * (n - 1)
    elif shape == "deep":  # mostly the previous node or a recent one: long paths with some forks
        parents = [-1] + [max(0, i - 1 - int(rng.expovariate(1.0))) for i in range(1, n)]
    else:  # uniform random recursive tree
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return tokens, parents


def root_path(tokens, parents, i) -> list[int]:
    path = []
    while i != -1:
        path.append(tokens[i])
        i = parents[i]
    return path[::-1]


def decode_sequentially(model, backend: str, context: list[int], path: list[int]) -> torch.Tensor:
    """Fresh session: plain prefill of ``context``, then one token at a time; logits after the last."""
    s = VerifierSession(model, backend=backend)
    s.prefill(context)
    logits = None
    for tok in path:
        hidden = s.backend.forward(torch.tensor([tok]), torch.tensor([s.length]), None)
        s.backend.commit(None, 1)
        logits = s.backend.logits(hidden)[0]
    return logits


def tree_forward_logits(session: VerifierSession, tokens, parents) -> torch.Tensor:
    positions, mask = tree_inputs(parents, session.length)
    hidden = session.backend.forward(torch.tensor(tokens), positions, mask)
    session.backend.commit([], len(tokens))
    return session.backend.logits(hidden)


@torch.inference_mode()
def plain_logits(model, seq: list[int]) -> torch.Tensor:
    """transformers' own forward over the whole sequence, no cache: the logits after its last token."""
    return model(torch.tensor([seq])).logits[0, -1]


def chain_logits(session: VerifierSession, tokens: list[int]) -> torch.Tensor:
    """Feeds ``tokens`` as a causal chain on top of the session's cache; their logits. The new rows
    are dropped again (``commit([])``), so the session is left as it was."""
    n = len(tokens)
    before = session.length
    positions, mask = tree_inputs([-1, *range(n - 1)], before)
    logits = session.backend.logits(session.backend.forward(torch.tensor(tokens), positions, mask))
    session.backend.commit([], n)
    assert session.length == before
    return logits


@torch.inference_mode()
def greedy_continuation(model, context: list[int], n: int) -> list[int]:
    seq = list(context)
    for _ in range(n):
        seq.append(int(plain_logits(model, seq).argmax()))
    return seq[len(context) :]


def trie_with_path(rng: random.Random, root: int, path: list[int], n_decoys: int, vocab: int):
    """A draft trie rooted at ``root`` holding ``path`` plus decoy branches (some sharing a prefix of
    it), siblings unique, flattened breadth-first with the real path inserted after the decoys of its
    depth so that the accepted nodes are not contiguous."""
    seqs = []
    for _ in range(n_decoys):
        share = rng.randrange(len(path) + 1)
        seqs.append(path[:share] + [rng.randrange(vocab) for _ in range(rng.randint(1, 3))])
    seqs.append(list(path))
    rng.shuffle(seqs)
    seqs.sort(key=lambda s: s is path)  # the real path last (stable for the rest)
    nodes = [(-1, root)]
    index: dict[tuple[int, int], int] = {}
    for seq in seqs:
        node = 0
        for t in seq:
            if (node, t) not in index:
                index[(node, t)] = len(nodes)
                nodes.append((node, t))
            node = index[(node, t)]
    depth = [0]
    for p, _ in nodes[1:]:
        depth.append(depth[p] + 1)
    order = sorted(range(len(nodes)), key=depth.__getitem__)
    new = {old: i for i, old in enumerate(order)}
    tokens = [nodes[o][1] for o in order]
    parents = [-1 if nodes[o][0] < 0 else new[nodes[o][0]] for o in order]
    return tokens, parents


def walk(tokens, parents, target: list[int]) -> list[int]:
    """Brute force (unique siblings): root-first indices of the deepest node whose root path, after the
    root, is a prefix of ``target``."""
    best, best_len = 0, 0
    for i in range(len(tokens)):
        p = root_path(tokens, parents, i)[1:]
        if p == target[: len(p)] and len(p) > best_len:
            best, best_len = i, len(p)
    chain = []
    while best != -1:
        chain.append(best)
        best = parents[best]
    return chain[::-1]


# -- every node's logits from one tree forward -----------------------------------------------------------

CASES = [  # (seed, context length, nodes, shape)
    (0, 5, 1, "random"),
    (1, 3, 2, "chain"),
    (2, 7, 9, "star"),
    (3, 12, 16, "random"),
    (4, 4, 12, "chain"),
    (5, 20, 24, "deep"),
    (6, 1, 13, "random"),
    (7, 9, 33, "deep"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed, ctx_len, n, shape", CASES)
def test_tree_node_logits_equal_sequential_decoding(tiny_llama, backend, seed, ctx_len, n, shape):
    model = tiny_llama
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    context = [rng.randrange(vocab) for _ in range(ctx_len)]
    tokens, parents = random_tree(rng, n, vocab, shape)
    if n > 3 and shape != "chain":  # duplicate siblings are legal input and must not confuse the mask
        parents[3] = parents[2]
        tokens[3] = tokens[2]

    session = VerifierSession(model, backend=backend)
    session.prefill(context)
    tree_logits = tree_forward_logits(session, tokens, parents)
    assert tuple(tree_logits.shape) == (n, vocab)

    for i in range(n):
        path = root_path(tokens, parents, i)
        seq = decode_sequentially(model, backend, context, path)
        torch.testing.assert_close(tree_logits[i], seq, atol=ATOL, rtol=0, msg=lambda m: f"node {i}: {m}")
        # and both equal transformers' plain forward over context + path
        torch.testing.assert_close(
            tree_logits[i], plain_logits(model, context + path), atol=ATOL, rtol=0, msg=lambda m: f"node {i}: {m}"
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_reports_the_tree_forward_topk(tiny_llama, backend):
    model = tiny_llama
    rng = random.Random(11)
    vocab = model.config.vocab_size
    context = [rng.randrange(vocab) for _ in range(8)]
    tokens, parents = random_tree(rng, 10, vocab, "random")
    session = VerifierSession(model, backend=backend, topk=5)
    session.prefill(context)
    res = session.verify(tokens, parents)
    assert len(res.topk) == len(tokens)
    for i in range(len(tokens)):
        ref = plain_logits(model, context + root_path(tokens, parents, i))
        assert res.topk[i] == torch.topk(ref, 5).indices.tolist(), f"node {i}"


def test_backends_are_the_ones_asked_for(tiny_llama):
    assert isinstance(VerifierSession(tiny_llama, backend="llama").backend, LlamaBackend)
    assert isinstance(VerifierSession(tiny_llama, backend="hf").backend, HFBackend)
    assert isinstance(VerifierSession(tiny_llama).backend, LlamaBackend)  # auto picks llama for Llama


# -- the KV cache after verify ------------------------------------------------------------------------------


def make_session(model, backend: str) -> VerifierSession:
    if backend == "llama-small":  # starts with room for 4 rows: prefill and verify must grow it
        s = VerifierSession(model, backend="llama")
        s.backend = LlamaBackend(model, capacity=4)
        return s
    return VerifierSession(model, backend=backend)


def prefilled(model, backend: str, rng: random.Random, ctx_len: int):
    """A session prefilled with a random context of ``ctx_len`` tokens: (context, session, root)."""
    context = [rng.randrange(model.config.vocab_size) for _ in range(ctx_len)]
    session = make_session(model, backend)
    return context, session, session.prefill(context).next_token


def assert_same_continuation(model, backend: str, session: VerifierSession, committed: list[int], rng) -> None:
    """``session`` must continue exactly like a fresh session prefilled with ``committed``."""
    assert session.length == len(committed)
    fresh = VerifierSession(model, backend="llama" if backend == "llama-small" else backend)
    fresh.prefill(committed)
    cont = [rng.randrange(model.config.vocab_size) for _ in range(4)]
    got = chain_logits(session, cont)
    want = chain_logits(fresh, cont)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # and the same as transformers without any cache
    torch.testing.assert_close(got[-1], plain_logits(model, committed + cont), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", [*BACKENDS, "llama-small"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_after_verify_holds_context_plus_accepted_path(tiny_llama, backend, seed):
    model = tiny_llama
    vocab = model.config.vocab_size
    rng = random.Random(100 + seed)
    context, session, root = prefilled(model, backend, rng, rng.randint(3, 10))
    committed = list(context)
    total_accepted = 0
    for _round in range(3):
        truth = greedy_continuation(model, committed + [root], 8)  # what the target will choose
        real = truth[: rng.randint(0, 6)]
        tokens, parents = trie_with_path(rng, root, real, n_decoys=rng.randint(2, 8), vocab=vocab)
        expected = walk(tokens, parents, truth)
        res = session.verify(tokens, parents)
        assert res.accepted == expected, (tokens, parents, truth)
        accepted_tokens = [tokens[i] for i in res.accepted]
        assert accepted_tokens[1:] == truth[: len(accepted_tokens) - 1]
        assert res.bonus == truth[len(accepted_tokens) - 1]
        committed += accepted_tokens
        total_accepted += len(res.accepted) - 1
        assert_same_continuation(model, backend, session, committed, rng)
        root = res.bonus
    assert total_accepted > 0, "the trees were meant to contain accepted paths"


@pytest.mark.parametrize("backend", [*BACKENDS, "llama-small"])
def test_kv_after_rejecting_everything_but_the_root(tiny_llama, backend):
    model = tiny_llama
    vocab = model.config.vocab_size
    rng = random.Random(7)
    context, session, root = prefilled(model, backend, rng, 6)
    right = greedy_continuation(model, context + [root], 1)[0]
    tokens = [root] + [t for t in range(vocab) if t != right][:20]
    parents = [-1] + [0] * 20
    res = session.verify(tokens, parents)
    assert res.accepted == [0]
    assert res.bonus == right
    assert_same_continuation(model, backend, session, context + [root], rng)


@pytest.mark.parametrize("backend", [*BACKENDS, "llama-small"])
def test_truncate_then_continue(tiny_llama, backend):
    model = tiny_llama
    vocab = model.config.vocab_size
    rng = random.Random(3)
    context, session, root = prefilled(model, backend, rng, 9)
    truth = greedy_continuation(model, context + [root], 5)
    res = session.verify([root, *truth[:4]], [-1, 0, 1, 2, 3])
    assert len(res.accepted) == 5
    assert session.length == len(context) + 5
    session.truncate(len(context) + 2)
    assert_same_continuation(model, backend, session, context + [root, truth[0]], rng)
    session.truncate(100)  # longer than the cache: no-op
    assert session.length == len(context) + 2
    # a later turn appended with prefill continues the truncated cache
    more = [rng.randrange(vocab) for _ in range(3)]
    session.prefill(more)
    assert_same_continuation(model, backend, session, context + [root, truth[0]] + more, rng)
