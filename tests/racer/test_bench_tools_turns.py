"""``racer bench-tools`` in process: a conversation keeps its drafter session and KV cache across its
turns, and every turn's answer equals Hugging Face greedy decoding of the whole conversation so far,
with the tenant corpus on, off, and without drafts."""

from __future__ import annotations

from pathlib import Path

from common.text import continue_ids, messages_ids
from drafter.corpus import Corpus, CorpusConfig
from racer.bench.tools import RUNS, _run_in_process, summarize
from racer.inprocess import InProcessStack
from racer.tool_sessions import parse
from tests.support.engine import hf_greedy
from tests.support.models import make_tiny_llama
from tests.support.tinytok import EOS, make_char_tokenizer
from verifier.model import LoadedModel

N = 16
TOOLS = [{"name": "weather", "parameters": {"city": "str"}}]


def test_every_turn_equals_hf_greedy_of_the_conversation_in_every_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    model = make_tiny_llama()
    tok = make_char_tokenizer()
    model.generation_config.eos_token_id = EOS
    engine = InProcessStack(LoadedModel(model, tok, Path(tmp_path)), prior=None)
    sessions = [
        parse({"tenant": "w", "system": "Tools:", "tools": TOOLS, "turns": [q, "And?"]}, f"x:{i}")
        for i, q in enumerate(("Paris?",))
    ]
    corpus = Corpus(CorpusConfig(max_tokens=4096))  # the second turn may draft from the first's answer
    results = []
    for i, s in enumerate(sessions):
        # the reference: HF greedy over each turn's whole conversation, the answers included
        want, history = [], []
        for t, turn in enumerate(s.turns):
            ids = (
                messages_ids(tok, s.first_messages())
                if t == 0
                else history + continue_ids(tok, history, list(turn), (EOS,))
            )
            want.append(hf_greedy(model, ids, N, eos=(EOS,)))
            history = ids + want[-1]
        for run in RUNS:
            r = _run_in_process(engine, s, run, 16, N, corpus if run == "on" else None)
            r.index = i
            results.append(r)
            assert r.output == want, (i, run)
            assert r.prompt_tokens == len(messages_ids(tok, s.first_messages()))
            assert all(x.ttft_s > 0 for x in r.turns)
    rows = summarize(results)
    assert rows[-1]["identical"] == "1/1" and rows[-1]["all_identical"]
