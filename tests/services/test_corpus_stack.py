"""``racer bench-corpus --through stack`` on the tiny model: real Redis, verifier, two drafters and a
gateway each. Consecutive sessions land on different replicas (read from the drafters' metrics),
every repeat is answered by another replica than its first answer and drafts from what
replication brought over, and the outputs are the same with the corpus on and off."""

from __future__ import annotations

import pytest

from racer.bench.corpus import summarize
from racer.bench.corpus_stack import OFF, corpus_tenant, replicas, run_stack
from racer.prompts import Prompt
from tests.support.stack import prompt

N = 40


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tiny_llama):
    path = tmp_path_factory.mktemp("tiny-llama-stack")
    tiny_llama.save_pretrained(path)
    return path


def test_the_repeat_run_through_two_replicas_alternates_them_and_drafts_from_the_other(tiny_model_dir):
    prompts = [(Prompt(str(i), "random", ""), prompt(60 + i, 12)) for i in range(3)]
    env = dict(RACER_THREADS="1", RACER_BACKEND="llama", OMP_NUM_THREADS="1", RACER_DRAIN_SECONDS="1")
    tenants = [corpus_tenant(16), OFF]
    with replicas(str(tiny_model_dir), 2, tenants, prior=False, pin=False, gateway_model="none", env=env) as st:
        run = run_stack(st, prompts, [16], N, "", progress=False, warm=prompt(59, 4))
    # prompt i: pass 1 on replica i mod 2, pass 2 on the other; corpus off and on alike
    assert run.sessions == {"pass 1": [4, 2], "pass 2": [2, 4]}
    assert run.crossed == 3
    assert all(r.identical for r in run.results)
    first = {r.question_id: r for r in run.results if r.group == "pass 1" and r.corpus}
    again = {r.question_id: r for r in run.results if r.group == "pass 2" and r.corpus}
    assert all(again[q].output == first[q].output for q in first)
    assert sum(r.accepted["corpus"] for r in again.values()) > 0
    assert all(r.drafted["corpus"] == 0 for r in run.results if not r.corpus)  # sharing off: no corpus
    rows = {(r["group"], r["budget"]): r for r in summarize(run.results)}
    assert rows[("pass 2", 16)]["mat_on"] > rows[("pass 1", 16)]["mat_on"]
    # every replica holds every token pass 1 generated, the last round of each response included
    generated = sum(len(r.output) for r in first.values())
    assert generated > 0 and run.corpus_tokens[16] == [generated, generated]
