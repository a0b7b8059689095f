"""``racer bench-corpus``'s sessions: lossless against Hugging Face greedy with the tenant corpus on,
and a prompt asked again drafts from the first answer."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from drafter.corpus import Corpus, CorpusConfig
from racer.bench.corpus import Result, format_table, run_one, summarize
from racer.inprocess import InProcessStack
from tests.support.engine import hf_greedy
from tests.support.models import make_tiny_llama
from tests.support.stack import prompt
from verifier.model import LoadedModel

N = 40


def test_sessions_with_the_corpus_equal_hf_greedy_and_a_repeat_drafts_from_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    model = make_tiny_llama()
    engine = InProcessStack(
        LoadedModel(model, SimpleNamespace(pad_token_id=0, eos_token_id=2), Path(tmp_path)), prior=None
    )
    corpus = Corpus(CorpusConfig(max_tokens=4096))
    prompts = [prompt(60 + i, 12) for i in range(3)]
    results = []
    for group in ("pass 1", "pass 2"):
        for i, p in enumerate(prompts):
            ref = hf_greedy(model, p, N, eos=(2,))
            off = run_one(engine, p, 16, N, None)
            on = run_one(engine, p, 16, N, corpus)
            assert on[0] == off[0] == ref, (group, i)
            for use, r in ((False, off), (True, on)):
                results.append(Result(group, str(i), use, 16, *r, identical=True))
    first = {r.question_id: r for r in results if r.group == "pass 1" and r.corpus}
    again = {r.question_id: r for r in results if r.group == "pass 2" and r.corpus}
    assert all(again[q].rounds <= first[q].rounds for q in first)
    assert sum(r.rounds for r in again.values()) < sum(r.rounds for r in first.values())
    assert sum(r.accepted["corpus"] for r in again.values()) > 0
    rows = {(r["group"], r["budget"]): r for r in summarize(results)}
    assert rows[("pass 2", 16)]["mat_on"] > rows[("pass 2", 16)]["mat_off"]
    assert rows[("overall", 16)]["identical"] == "6/6"
    assert "pass 2" in format_table(list(rows.values()))
