"""The function-calling benchmark's input: the JSONL session format, the BFCL converter, the tenant
selection and the report's bookkeeping (no model: the runs themselves are benchmarks)."""

import argparse
import json

import pytest

from racer import tool_sessions as ts
from racer.bench.tools import SessionRun, Turn, prefix_counters, select, summarize

WEATHER = [
    {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "dict", "required": ["city"], "properties": {"city": {"type": "string"}}},
    }
]
CALENDAR = [{"name": "add_event", "description": "Adds an event.", "parameters": {"type": "dict", "properties": {}}}]


def _bfcl(qid, functions, turns):
    return json.dumps({"id": qid, "question": turns, "function": functions})


BFCL_LINES = [
    _bfcl("live_0-0-0", CALENDAR, [[{"role": "user", "content": "Lunch with Ann on Friday"}]]),
    _bfcl("live_1-1-0", WEATHER, [[{"role": "user", "content": "Weather in Paris?"}]]),
    _bfcl(
        "live_2-1-1",
        WEATHER,
        [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "And in Rome?"}]],
    ),
    _bfcl("live_3-1-2", WEATHER, [[{"role": "user", "content": "Oslo"}], [{"role": "user", "content": "Tomorrow?"}]]),
]


def test_a_record_renders_its_tools_as_the_system_prompt():
    s = ts.parse({"tenant": "w", "tools": WEATHER, "turns": ["Weather in Paris?"]}, "x:1")
    assert s.system.startswith(ts.PREAMBLE)
    assert json.loads(s.system[len(ts.PREAMBLE) :]) == WEATHER
    assert s.first_messages() == [
        {"role": "system", "content": s.system},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    own = ts.parse({"tenant": "w", "system": "Be terse.", "tools": WEATHER, "turns": ["hi"]}, "x:2")
    assert own.system.startswith("Be terse.\n[") and ts.PREAMBLE not in own.system
    plain = ts.parse(
        {"tenant": "w", "system": "Be terse.", "turns": ["hi", [{"role": "user", "content": "again"}]]}, "x"
    )
    assert plain.system == "Be terse." and len(plain.turns) == 2 and plain.turns[1][0]["content"] == "again"
    assert plain.session == "x"  # no name given: where it was read


@pytest.mark.parametrize(
    "rec, field",
    [
        ({"turns": ["hi"]}, "tenant"),
        ({"tenant": "t"}, "turns"),
        ({"tenant": "t", "turns": []}, "turns"),
        ({"tenant": "t", "turns": [[{"role": "tool", "content": "x"}]]}, "turns[0]"),
        ({"tenant": "t", "turns": [[{"role": "user"}]]}, "turns[0]"),
        ({"tenant": "t", "turns": ["hi"], "tools": {"name": "f"}}, "tools"),
        ({"tenant": "t", "turns": ["hi"], "system": 3}, "system"),
        ([], "JSON object"),
    ],
)
def test_a_bad_record_is_refused_naming_its_line_and_field(rec, field):
    with pytest.raises(ValueError) as e:
        ts.parse(rec, "f.jsonl:7")
    assert str(e.value).startswith("f.jsonl:7: ") and field in str(e.value)


def test_bfcl_groups_queries_by_tool_set_largest_tenant_first():
    records = ts.from_bfcl(BFCL_LINES, "live")
    # the weather set (3 queries, seen second) comes before the calendar set (1 query, seen first)
    assert [(r["tenant"], r["session"]) for r in records] == [
        ("live-1", "live_1-1-0"),
        ("live-1", "live_2-1-1"),
        ("live-1", "live_3-1-2"),
        ("live-0", "live_0-0-0"),
    ]
    assert all(r["tools"] == WEATHER for r in records[:3])
    assert records[1]["turns"][0][0] == {"role": "system", "content": "Answer briefly."}
    assert len(records[2]["turns"]) == 2
    with pytest.raises(ValueError, match="live:2: not a BFCL record"):
        ts.from_bfcl([BFCL_LINES[0], json.dumps({"id": "x", "question": []})], "live")


def test_a_converted_bfcl_file_reads_back_as_the_file_itself_does(tmp_path):
    src = tmp_path / "BFCL_v4_live_multiple.json"
    src.write_text("\n".join(BFCL_LINES) + "\n")
    dst = tmp_path / "sessions.jsonl"
    assert ts.convert_bfcl(str(src), str(dst)) == 4
    converted = ts.load(str(dst))  # read as this format
    direct = ts.load(str(src))  # recognized as BFCL and converted on the fly
    assert [(s.tenant, s.system, s.turns) for s in converted] == [(s.tenant, s.system, s.turns) for s in direct]
    tenants = ts.by_tenant(converted)
    assert list(tenants) == ["live-multiple-1", "live-multiple-0"]
    assert len({s.system for s in tenants["live-multiple-1"]}) == 1  # one system prompt per tool set
    assert [len(s.turns) for s in tenants["live-multiple-1"]] == [1, 1, 2]


def test_selection_keeps_tenants_with_later_sessions_and_cuts_sessions_and_turns(tmp_path):
    sessions = [ts.parse(r, "x") for r in ts.from_bfcl(BFCL_LINES, "live")]
    args = argparse.Namespace(tenants=5, sessions=2, turns=1, min_system_chars=0)
    chosen = select(sessions, args)
    assert list(chosen) == ["live-1"]  # live-0 has one session: no later one to compare
    assert [len(s.turns) for s in chosen["live-1"]] == [1, 1]
    with pytest.raises(ValueError, match="no tenant"):
        select(sessions, argparse.Namespace(tenants=5, sessions=2, turns=1, min_system_chars=10**6))


def _run(tenant, index, run, outputs, ttft=1.0, rounds=1, prefix=None):
    r = SessionRun(tenant, index, run, 100, prefix=prefix)
    r.turns = [Turn(list(o), rounds, ttft, ttft + 1.0) for o in outputs]
    return r


def test_the_report_compares_first_and_later_sessions_and_checks_every_run_alike():
    prefix = {"hits": 1.0, "misses": 0.0, "saved": 64.0}
    results = []
    for i, ttft in enumerate((8.0, 1.0, 3.0)):
        results.append(_run("a", i, "on", [[1, 2, 3, 4]], ttft, rounds=2, prefix=prefix))
        results.append(_run("a", i, "corpus off", [[1, 2, 3, 4]], ttft, rounds=4, prefix=prefix))
        # the third session's plain decoding differs: it must show
        results.append(_run("a", i, "off", [[1, 2, 3, 5 if i == 2 else 4]], ttft, rounds=4, prefix=prefix))
    rows = summarize(results)
    a, overall = rows
    assert (a["ttft_first"], a["ttft_later"], a["ttft_ratio"]) == (8.0, 2.0, 0.25)
    assert (a["mat_on"], a["mat_nocorpus"]) == (2.0, 1.0)
    assert a["identical"] == "2/3" and not a["all_identical"]
    assert a["prefix"] == {"hits": 3.0, "misses": 0.0, "saved": 192.0}
    assert overall["identical"] == "2/3" and overall["ttft_ratio"] == 0.25


def test_prefix_counters_are_read_when_the_verifier_exports_them():
    samples = {
        ("racer_verifier_prefix_cache_lookups_total", (("outcome", "hit"), ("replica", "a"))): 2.0,
        ("racer_verifier_prefix_cache_lookups_total", (("outcome", "hit"), ("replica", "b"))): 1.0,
        ("racer_verifier_prefix_cache_lookups_total", (("outcome", "miss"),)): 4.0,
        ("racer_verifier_prefix_cache_saved_tokens_total", ()): 300.0,
        ("racer_verifier_prefill_tokens_total", ()): 9.0,
    }
    assert prefix_counters(samples) == {"hits": 3.0, "misses": 4.0, "saved": 300.0}
    assert prefix_counters({("racer_verifier_prefill_tokens_total", ()): 9.0}) is None
