"""The gateway's grammar masks: each tree node's row is the mask after that node's own path, as a
fresh matcher fed the path token by token gives it; forced drafts are what the grammar accepts."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from common.errors import Abort
from gateway.grammar import Grammars, GrammarSpec, allowed
from gateway.tools import call_schema
from tests.support.tinytok import EOS, JSON, make_char_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["city", "n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars():
    tok = make_char_tokenizer(96, JSON)
    return Grammars(tok, 96, (EOS,)), tok


def _fresh(grammars, spec, tokens) -> np.ndarray | None:
    c = grammars.constraint(spec)
    for t in tokens:
        if not allowed(c._fill(), t):
            return None
        c.advance([t])
    return c._fill()


@pytest.mark.parametrize("seed", range(6))
def test_tree_masks_are_each_paths_own(grammars, seed):
    g, tok = grammars
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    rng = random.Random(seed)
    c = g.constraint(spec)
    text = '{"city": "Paris", "n": 1'[: rng.randrange(1, 20)]
    done = tok(text, add_special_tokens=False)["input_ids"]
    c.advance(done)
    # a tree whose nodes are mostly allowed tokens (random walks), some not
    tokens, parents = [done[-1]], [-1]
    for _ in range(40):
        p = rng.randrange(len(tokens))
        tokens.append(rng.randrange(6, 96))
        parents.append(p)
    rows = np.frombuffer(c.tree_masks(tokens, parents), np.int32).reshape(len(tokens), -1)
    for i in range(len(tokens)):
        chain, j = [], i
        while j > 0:
            chain.append(tokens[j])
            j = parents[j]
        want = _fresh(g, spec, done + chain[::-1])
        if want is not None:
            assert np.array_equal(rows[i], want), i
    assert np.array_equal(np.frombuffer(c.open_mask(), np.int32), _fresh(g, spec, done[:-1]))


def test_forced_drafts_are_accepted_by_the_grammar(grammars):
    g, tok = grammars
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    c = g.constraint(GrammarSpec("tool_call", json.dumps(call_schema(tools, "get_weather")), "tools"))
    forced = c.forced(64)
    assert tok.decode(forced).startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    c.advance(forced)  # raises if the grammar refuses one
    assert c.forced(64) == []  # Paris or Oslo: a choice


def test_a_refused_schema_names_its_field(grammars):
    g, _ = grammars
    with pytest.raises(Abort) as e:
        g.compile(GrammarSpec("json_schema", json.dumps({"type": "nope"}), "response_format"))
    assert e.value.field == "response_format" and "nope" in e.value.message
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    assert g.compile(spec) is g.compile(spec)  # cached


def test_json_object_is_an_object(grammars):
    g, tok = grammars
    c = g.constraint(GrammarSpec("json_object"))
    first = np.flatnonzero(np.unpackbits(c._fill().view(np.uint8), bitorder="little"))
    assert tok.decode([int(t) for t in first]) == "{"
