"""Bad input, generated: the public Generate API and the internal Drafter and Verifier streams.

Every request is checked against a model of the rules: a bad one must get one of the statuses its
faults call for, with a message that names the field; a good one must stream what plain greedy
decoding produces. Meanwhile another session streams, and afterwards nothing is left running.
"""

from __future__ import annotations

import math
import queue
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from common.params import MODES
from common.text import continue_ids, messages_ids
from common.v1 import drafter_pb2 as dpb
from common.v1 import drafter_pb2_grpc as dgrpc
from common.v1 import generation_pb2 as pb
from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.holds import held_rounds
from tests.support.stack import INTERNAL_TOKEN, backend_channel, start_drafter, start_stack, wait_until
from tests.support.tinytok import make_char_tokenizer

IA, NF, RE, FP, UA, AB = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ABORTED,
)
VOCAB = 96
MAX_PROMPT, MAX_NEW, MAX_BUDGET = 48, 24, 16
MAX_MESSAGE = 64 * 1024
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def env(loop_thread, tiny_llama, tok, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("key-a acme\nkey-b globex\n")
    st_ = start_stack(
        loop_thread,
        tiny_llama,
        drafters=2,
        api_keys=str(keys),
        tokenizer=tok,
        eos_ids=(),
        max_prompt_tokens=MAX_PROMPT,
        max_new_tokens=MAX_NEW,
        max_budget=MAX_BUDGET,
        max_message_bytes=MAX_MESSAGE,
        max_sessions_per_tenant=4,
        queue_max_waiters=1,
    )
    a, b = Client(st_.gateway, api_key="key-a", timeout=30), Client(st_.gateway, api_key="key-b", timeout=30)
    own_p = prompt(1, 8)
    own_ids, _, last = a.complete(own_p, max_new_tokens=4)
    other = b.complete(prompt(2, 8), max_new_tokens=2)[2].session_id
    closed = a.complete(prompt(3, 8), max_new_tokens=2)[2].session_id
    a.close_session(closed)
    full_p = prompt(4, 30)
    full_ids, _, full = a.complete(full_p, max_new_tokens=12)  # 42 of MAX_PROMPT=48 tokens: most turns overflow it
    sessions = {"own": last.session_id, "full": full.session_id, "other": other, "closed": closed, "unknown": "A" * 24}
    yield st_, a, sessions, {last.session_id: own_p + own_ids, full.session_id: full_p + full_ids}
    a.close()
    b.close()
    st_.stop()


def _waiters(tenant: str) -> float | None:
    return REGISTRY.get_sample_value("racer_queue_waiters", {"tenant": tenant})


# -- the public API ---------------------------------------------------------------------------------
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
text = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)


def mostly(good, bad):
    """``good`` but one time in twenty: most requests have one fault or none, and reach the deeper checks."""
    return st.sampled_from(range(20)).flatmap(lambda i: bad if i == 7 else good)


@st.composite
def generate_requests(draw):
    r = pb.GenerateRequest()
    kind = draw(st.sampled_from(["ids", "ids", "ids", "prompt", "chat", "none"]))
    if kind == "ids":
        n = draw(mostly(st.sampled_from([1, 5, 12]), st.sampled_from([0, MAX_PROMPT + 1])))
        ids = draw(st.lists(st.integers(6, VOCAB - 1), min_size=n, max_size=n))
        if ids and draw(mostly(st.just(False), st.just(True))):
            ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([-1, VOCAB, 2**31 - 1, -(2**31)]))
        r.prompt_ids.ids.extend(ids)
        if not ids:
            r.prompt_ids.SetInParent()
    elif kind == "prompt":
        r.prompt = draw(mostly(text.filter(bool), st.sampled_from(["", "x" * 64 * MAX_PROMPT + "x", "word " * 12])))
    elif kind == "chat":
        r.chat.SetInParent()
        for _ in range(draw(mostly(st.integers(1, 2), st.just(0)))):
            role = draw(mostly(st.sampled_from(["user", "system", "assistant"]), st.sampled_from(["tool", "", "USER"])))
            r.chat.messages.add(role=role, content=draw(text))
    r.session_id = draw(
        st.sampled_from(["", "", "", "own", "own", "full", "other", "closed", "unknown", "bad id!", "x" * 200])
    )
    r.max_new_tokens = draw(mostly(st.sampled_from([0, 1, 3, 8]), st.sampled_from([-1, MAX_NEW + 1, 2**31 - 1])))
    r.temperature = draw(mostly(st.sampled_from([0.0, 0.0, -0.0, 0.7]), f32))
    r.top_p = draw(mostly(st.sampled_from([0.0, 1.0, 0.9]), f32))
    r.top_k = draw(mostly(st.sampled_from([0, 0, 5]), st.sampled_from([-1, -(2**31)])))
    if draw(st.booleans()):
        r.seed = draw(st.integers(-(2**63), 2**63 - 1))
    r.stop.extend(
        draw(
            mostly(
                st.one_of(st.just([]), st.lists(text.filter(bool), max_size=2)),
                st.sampled_from([[""], ["a"] * 17, ["y" * 300]]),
            )
        )
    )
    r.stop_ids.extend(
        draw(
            mostly(
                st.one_of(st.just([]), st.lists(st.integers(0, VOCAB - 1), max_size=2)),
                st.one_of(st.lists(st.integers(-2, VOCAB + 2), min_size=1, max_size=3), st.just([7] * 65)),
            )
        )
    )
    r.speculation.mode = draw(mostly(st.sampled_from(["", "racer", "off", "pld"]), st.sampled_from(["magic", "RACER"])))
    r.speculation.budget = draw(mostly(st.sampled_from([0, 1, 4, MAX_BUDGET]), st.sampled_from([MAX_BUDGET + 1, -3])))
    r.system = draw(st.sampled_from(["", "", "", "Be brief."]))
    key = draw(st.sampled_from(["key-a"] * 12 + [None, "wrong"]))
    return r, key


def faults(r: pb.GenerateRequest, key, sessions: dict, histories: dict, tok):
    """The statuses (code, field named in the message) this request calls for; empty: it is good.
    Also returns the turn's token ids when the input is good (for the reference output)."""
    if key != "key-a":
        return {(UA, "API key")}, None
    out = set()
    lim_new = r.max_new_tokens or min(256, MAX_NEW)
    if not 1 <= lim_new <= MAX_NEW:
        out.add((IA, "max_new_tokens"))
    if (r.speculation.mode or "racer") not in MODES:
        out.add((IA, "speculation.mode"))
    if not 0 <= r.speculation.budget <= MAX_BUDGET:  # 0: adaptive
        out.add((IA, "speculation.budget"))
    if not math.isfinite(r.temperature) or r.temperature < 0:
        out.add((IA, "temperature"))
    top_p = r.top_p or 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        out.add((IA, "top_p"))
    if r.top_k < 0:
        out.add((IA, "top_k"))
    if len(r.stop) > 16 or any(len(s) > 256 for s in r.stop) or any(s == "" for s in r.stop):
        out.add((IA, "stop"))
    if len(r.stop_ids) > 64 or any(not 0 <= t < VOCAB for t in r.stop_ids):
        out.add((IA, "stop_ids"))
    kind = r.WhichOneof("input")
    if r.system and kind != "prompt":
        out.add((IA, "system"))
    if out:
        return out, None  # checked before anything else
    sid = sessions.get(r.session_id, r.session_id)
    history: list[int] = []
    if r.session_id:
        if r.session_id in ("bad id!", "x" * 200):
            return {(IA, "session_id")}, None
        if sid not in histories:
            return {(NF, "session_id")}, None
        history = histories[sid]
    if kind is None:
        return {(IA, "input")}, None
    if kind == "prompt_ids":
        ids = list(r.prompt_ids.ids)
        if not ids or any(not 0 <= t < VOCAB for t in ids):
            return {(IA, "prompt_ids")}, None
        turn = ids
    else:
        if kind == "prompt":
            if not r.prompt:
                return {(IA, "prompt")}, None
            if len(r.prompt) + len(r.system) > 64 * MAX_PROMPT:
                return {(IA, "prompt")}, None
            messages = [{"role": "user", "content": r.prompt}]
            if r.system and not history:
                messages.insert(0, {"role": "system", "content": r.system})
        else:
            messages = [{"role": m.role, "content": m.content} for m in r.chat.messages]
            if not messages or any(m["role"] not in ("system", "user", "assistant") for m in messages):
                return {(IA, "chat.messages")}, None
        turn = continue_ids(tok, history, messages, ()) if history else messages_ids(tok, messages)
    if len(turn) > MAX_PROMPT:
        return {(IA, kind)}, None
    if len(history) + len(turn) > MAX_PROMPT:
        return {(FP, "session_id")}, None
    return set(), turn


def test_generate_fuzz(env, tiny_llama, tok):
    stack, a, sessions, histories = env
    # another tenant's long stream runs through the whole fuzz and must come out untouched
    bystander: dict = {}
    by_prompt = prompt(9, 10)

    def bystand():
        with Client(stack.gateway, api_key="key-b", timeout=120) as b:
            bystander["ids"] = b.complete(by_prompt, max_new_tokens=MAX_NEW, budget=2, mode="off")[0]

    t = threading.Thread(target=bystand)
    t.start()
    seen: dict[str, int] = {}
    fields: dict[str, int] = {}

    @FUZZ
    @given(generate_requests())
    def check(case):
        r, key = case
        want, turn = faults(r, key, sessions, histories, tok)
        req = pb.GenerateRequest()
        req.CopyFrom(r)
        if r.session_id in sessions:
            req.session_id = sessions[r.session_id]
        md = (("authorization", f"Bearer {key}"),) if key else ()
        ids: list[int] = []
        last = None
        try:
            for resp in a.stub.Generate(req, metadata=md, timeout=30):
                ids.extend(resp.token_ids)
                last = resp
        except grpc.RpcError as e:
            got = e.code()
            assert want, f"a good request failed: {got.name}: {e.details()}"
            assert any(got == code and field in e.details() for code, field in want), (got, e.details(), want)
            seen[got.name] = seen.get(got.name, 0) + 1
            fields[e.details().split(":")[0][:30]] = fields.get(e.details().split(":")[0][:30], 0) + 1
            return
        assert not want, f"a bad request was accepted: {want}"
        seen["OK"] = seen.get("OK", 0) + 1
        max_new = r.max_new_tokens or MAX_NEW
        assert last.finish_reason in ("stop", "length") and len(ids) == last.usage.completion_tokens <= max_new
        sid = last.session_id
        history = histories.get(sid, []) + turn
        if r.temperature == 0 and not r.stop and not r.stop_ids:
            assert ids == hf_greedy(tiny_llama, history, max_new), "a good request's output is not greedy's"
        if r.session_id:  # the session moved on: keep our model of it in step
            histories[sid] = history + ids
        assert last.usage.session_tokens == len(history + ids)

    check()
    t.join(120)
    assert bystander["ids"] == hf_greedy(tiny_llama, by_prompt, MAX_NEW), "another session was affected"
    assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED", "FAILED_PRECONDITION"} <= set(seen), seen
    print("generate fuzz statuses:", seen, fields)
    _nothing_left_running(stack)


def _nothing_left_running(stack):
    gw = stack.gateway_pair[1]
    wait_until(lambda: not gw._turns, timeout=5, what="gateway turns ended")
    wait_until(
        lambda: (
            not any(s.streaming for i in range(len(stack.drafters)) for s in stack.drafter_sessions(i))
            and not any(s.streaming for s in stack.verifier_sessions())
        ),
        timeout=5,
        what="backend streams ended",
    )


def test_oversized_messages_and_limits(env):
    stack, a, sessions, histories = env
    # a message over max_message_bytes: refused by gRPC before the gateway reads it
    with pytest.raises(grpc.RpcError) as e:
        a.complete([7] * (MAX_MESSAGE + 1), max_new_tokens=2)
    assert e.value.code() == RE and "message" in e.value.details().lower()
    with pytest.raises(grpc.RpcError) as e:
        a.complete("word " * 2000, max_new_tokens=2)  # under the message limit, over the token limit
    assert e.value.code() == IA and "prompt" in e.value.details() and "max_prompt_tokens" in e.value.details()
    # max_sessions_per_tenant=4: a fifth concurrent session of the tenant waits its turn... (the four
    # turns' rounds are held after their first chunk: they run until released, on any machine)
    verifiers = [core for _, core in stack.verifiers]
    with ThreadPoolExecutor(1) as pool, held_rounds(stack.lt, verifiers, tenants=["acme"]) as hold:
        calls = [a.generate(prompt(50 + i), max_new_tokens=MAX_NEW, budget=1, mode="off") for i in range(4)]
        for c in calls:
            next(c)
        fifth = pool.submit(a.complete, prompt(60), max_new_tokens=2)
        wait_until(lambda: _waiters("acme") == 1, timeout=30, what="the fifth turn queued")
        # ...past the queue's bound (queue_max_waiters=1) a sixth is refused at once, with a retry hint...
        with pytest.raises(grpc.RpcError) as e:
            a.complete(prompt(61), max_new_tokens=2)
        assert e.value.code() == RE and "max_sessions_per_tenant=4" in e.value.details()
        assert "queue_max_waiters=1" in e.value.details()
        hints = dict(e.value.trailing_metadata())
        assert int(hints["retry-after"]) >= 1 and int(hints["grpc-retry-pushback-ms"]) >= 1000
        status = status_pb2.Status.FromString(hints["grpc-status-details-bin"])
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info) and info.retry_delay.seconds >= 1
        # ...another tenant is not limited by it
        with Client(stack.gateway, api_key="key-b", timeout=30) as b:
            assert len(b.complete(prompt(62), max_new_tokens=2)[0]) == 2
        assert not fifth.done() and _waiters("acme") == 1
        hold.release()
        for c in calls:
            list(c)
        assert len(fifth.result(60)[0]) == 2
    assert _waiters("acme") is None  # the tenant's label goes with its queue
    assert len(a.complete(prompt(63), max_new_tokens=2)[0]) == 2
    # a second turn of a session while one runs: ABORTED, the running one is unaffected
    p0 = prompt(65, 6)
    ids0, _, last = a.complete(p0, max_new_tokens=4)
    sid = last.session_id
    histories[sid] = p0 + ids0
    with held_rounds(stack.lt, verifiers, sessions=[sid]) as hold:  # the turn runs until released
        call = a.generate(prompt(63, 4), session_id=sid, max_new_tokens=MAX_NEW, budget=1, mode="off")
        next(call)
        with pytest.raises(grpc.RpcError) as e:
            a.complete(prompt(64, 4), session_id=sid, max_new_tokens=2)
        assert e.value.code() == AB and "session_id" in e.value.details()
        # CloseSession while the turn runs ends it (ABORTED, not saved) and the session is gone
        assert a.close_session(sid).closed
        hold.release()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == AB and "closed" in e.value.details()
    del histories[sid]
    with pytest.raises(grpc.RpcError) as e:
        a.complete(prompt(64, 4), session_id=sid, max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    _nothing_left_running(stack)


# -- the internal APIs ------------------------------------------------------------------------------
class _Stream:
    """A bidi stream driven message by message: ``send`` returns the response or raises RpcError."""

    def __init__(self, method):
        self.q: queue.Queue = queue.Queue()
        self.responses = method(iter(self.q.get, None), timeout=30)

    def send(self, msg):
        self.q.put(msg)
        return next(self.responses)

    def close(self):
        self.q.put(None)
        self.responses.cancel()


def _tree_cases():
    """(tokens, parents, what is wrong: a field name, or None)."""
    tokens = st.integers(0, VOCAB - 1)
    good = st.integers(1, 12).flatmap(
        lambda n: st.tuples(st.lists(tokens, min_size=n, max_size=n), st.just(n)).flatmap(
            lambda tn: st.tuples(
                st.just(tn[0]),
                st.tuples(*[st.just(-1)] + [st.integers(0, i - 1) for i in range(1, tn[1])]).map(list),
                st.just(None),
            )
        )
    )

    def spoil(case, how):
        toks, parents, _ = case
        toks, parents = list(toks), list(parents)
        n = len(toks)
        if how == "cycle" and n > 1:
            i = n - 1
            parents[i] = i  # a node its own parent (or any later node): a cycle or a forward edge
        elif how == "forward" and n > 2:
            parents[1] = n - 1
        elif how == "range" and n > 1:
            parents[n - 1] = -2 if n % 2 else n + 5
        elif how == "root":
            parents[0] = 0
        elif how == "length":
            parents.append(0)
        elif how == "vocab":
            toks[n // 2] = VOCAB + 3 if n % 2 else -1
        elif how == "empty":
            return [], [], "tree.tokens"
        elif how == "huge":
            return [5] * 4097, [-1] + list(range(4096)), "tree.tokens"
        else:
            return toks, parents, None
        field = "tree.tokens" if how == "vocab" else "tree.parents"
        return toks, parents, field

    return st.tuples(
        good, st.sampled_from(["none", "none", "cycle", "forward", "range", "root", "length", "vocab", "empty", "huge"])
    ).map(lambda x: spoil(*x))


def _spoil_open(op, kind: str):
    """The open cases both services share: spoils ``op`` and returns the (status, field) it must
    get, or None for the other kinds."""
    if kind == "no-id":
        op.session_id = ""
        return IA, "open.session_id"
    if kind == "no-tenant":
        op.tenant = ""
        return IA, "open.tenant"
    if kind == "empty":
        del op.history[:]
        return IA, "open.history"
    return None


def test_verifier_stream_fuzz(env, tiny_llama):
    stack, *_ = env
    ch = backend_channel(stack.verifier_target(0))
    stub = vgrpc.VerifierStub(ch)
    counts: dict[str, int] = {}
    n_case = [0]

    @FUZZ
    @given(
        st.sampled_from(["ok", "ok", "no-id", "no-tenant", "empty", "vocab", "sampling", "huge", "tree-first", "kind"]),
        st.lists(_tree_cases(), min_size=1, max_size=3),
        st.booleans(),
    )
    def check(open_kind, trees, twice):
        n_case[0] += 1
        s = _Stream(stub.Session)
        try:
            op = vpb.VerifierOpen(session_id=f"fz{n_case[0]}", tenant="fuzz", history=prompt(n_case[0], 6))
            want = _spoil_open(op, open_kind)
            if open_kind == "vocab":
                op.history.append(VOCAB)
                want = (IA, "open.history")
            elif open_kind == "sampling":
                op.sampling.top_p, want = 1.5, (IA, "top_p")
            elif open_kind == "huge":
                op.history.extend([7] * 262_144)
                want = (RE, "open.history")
            first = vpb.VerifyRequest(open=op)
            if open_kind == "tree-first":
                first, want = vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=[1], parents=[-1])), (FP, "open")
            elif open_kind == "kind":
                first, want = vpb.VerifyRequest(), (IA, "request")
            if not _open(stub, s, first, want, vpb.VerifyRequest(open=op) if twice else None, counts):
                return
            for toks, parents, field in trees:
                req = vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=toks, parents=parents))
                if field:
                    _expect(lambda: s.send(req), IA, field, counts)
                    return
                res = s.send(req)
                acc = list(res.accepted)
                assert acc[0] == 0 and all(parents[acc[i + 1]] == acc[i] for i in range(len(acc) - 1))
                assert len(res.topk) == len(toks) * res.topk_width
                counts["OK"] = counts.get("OK", 0) + 1
            _expect(lambda: s.send(vpb.VerifyRequest(open=op)), FP, "open", counts)  # one session per stream
        finally:
            s.close()

    check()
    ch.close()
    print("verifier fuzz statuses:", counts)
    assert {"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "ABORTED"} <= set(counts), counts
    _nothing_left_running(stack)
    assert all(not s.streaming for s in stack.verifier_sessions())


def _expect(call, code, field, counts):
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code and field in e.value.details(), (e.value.code(), e.value.details(), code, field)
    counts[code.name] = counts.get(code.name, 0) + 1


def _open(stub, s, first, want, again, counts) -> bool:
    """Sends a stream's first message: False once it got the refusal ``want`` (None: it must be
    accepted) and the case ends there. ``again``: the same open on a second stream while this one
    is open, which must be ABORTED (one stream per session)."""
    if want:
        _expect(lambda: s.send(first), *want, counts)
        return False
    s.send(first)
    if again is not None:
        s2 = _Stream(stub.Session)
        _expect(lambda: s2.send(again), AB, "session", counts)
        s2.close()
    return True


DRAFTER_STEPS = st.lists(
    st.sampled_from(
        [
            "ok",
            "ok",
            "ok",
            "topk-size",
            "topk-neg",
            "accepted-root",
            "accepted-range",
            "accepted-path",
            "commit",
            "plain",
            "plain-topk",
            "budget",
            "mode",
            "root",
            "end",
        ]
    ),
    min_size=1,
    max_size=4,
)


DRAFTER_OPENS = st.sampled_from(
    [
        "ok",
        "ok",
        "no-id",
        "no-tenant",
        "empty",
        "negative",
        "topk",
        "rows",
        "rows-neg",
        "too-many-rows",
        "slope-size",
        "slope-neg",
        "huge",
        "step-first",
        "end-first",
        "kind",
    ]
)


def _drafter_first(op, kind: str, k: int):
    """The first message of a fuzzed drafter stream, ``op`` spoiled by ``kind``, and the (status,
    field) it must get (None: a good open)."""
    want = _spoil_open(op, kind)
    if kind == "negative":
        op.history.append(-4)
        want = (IA, "open.history")
    elif kind == "topk":
        op.topk, want = 3, (IA, "open.topk")
    elif kind == "rows":
        op.history_topk.append(1)
        want = (IA, "open.history_topk")
    elif kind == "rows-neg":
        op.history_topk[3] = -1
        want = (IA, "open.history_topk")
    elif kind == "too-many-rows":
        op.history_topk.extend([7] * (k * 10))
        want = (IA, "open.history_topk")
    elif kind in ("slope-size", "slope-neg"):  # a cost curve whose context slope is malformed
        op.cost.sizes[:], op.cost.ms[:], op.cost.context = [1, 4], [5.0, 6.0], 256
        op.cost.ms_per_token[:] = [0.002] if kind == "slope-size" else [0.002, -0.001]
        want = (IA, "open.cost")
    elif kind == "huge":
        op.history.extend([7] * 65_536)
        want = (RE, "open.history")
    if kind == "step-first":
        return dpb.DraftRequest(step=dpb.DraftStep(root=1, budget=4)), (FP, "open")
    if kind == "end-first":
        return dpb.DraftRequest(end_turn=dpb.EndTurn()), (FP, "open")
    if kind == "kind":
        return dpb.DraftRequest(), (IA, "request")
    return dpb.DraftRequest(open=op), want


def _drafter_step(how: str, tree, k: int):
    """A step after ``tree`` (the previous step's draft, or None), spoiled by ``how``, and the field
    it must be refused for (None: a good step)."""
    step = dpb.DraftStep(root=9, budget=6, mode="racer")
    if tree is not None:
        n = len(tree.tokens)
        step.tree_topk.extend([11] * (n * k))
        step.accepted.append(0)
        step.commit = 1
    if how == "topk-size":
        step.tree_topk.append(3)
        return step, "step.tree_topk" if tree is not None else "step"
    if how in ("budget", "mode", "root"):
        if how == "budget":
            step.budget = -1  # 0 is adaptive
        elif how == "mode":
            step.mode = "magic"
        else:
            step.root = -7
        return step, f"step.{how}"
    if tree is None:
        return step, None
    if how == "topk-neg":
        step.tree_topk[0] = -1
        return step, "step.tree_topk"
    if how == "accepted-root":
        step.accepted[0] = 1 if len(tree.tokens) > 1 else 5
        return step, "step.accepted"
    if how == "accepted-range":
        step.accepted.append(len(tree.tokens) + 2)
        return step, "step.accepted"
    if how == "accepted-path" and len(tree.tokens) > 2:
        bad = next((i for i in range(2, len(tree.tokens)) if tree.parents[i] != 0), None)
        if bad is not None:
            step.accepted.append(bad)
            return step, "step.accepted"
    if how == "commit":
        step.commit = 2
        return step, "step.commit"
    if how == "plain":  # a fixed budget never rests: no round went without a tree
        step.plain.append(5)
        step.plain_topk.extend([11] * k)
        return step, "step.plain"
    if how == "plain-topk":
        step.plain.append(5)
        step.plain_topk.extend([11] * (k - 1))
        return step, "step.plain_topk"
    return step, None


def test_drafter_stream_fuzz(env):
    stack, *_ = env
    ch = backend_channel(stack.drafter_target(0))
    stub = dgrpc.DrafterStub(ch)
    k = 8
    counts: dict[str, int] = {}
    n_case = [0]

    @FUZZ
    @given(
        DRAFTER_OPENS,
        DRAFTER_STEPS,
        st.booleans(),
    )
    @example("huge", ["ok"], False)  # the statuses asserted below must not hang on what the draws happen to be
    @example("slope-size", ["ok"], False)
    @example("slope-neg", ["ok"], False)
    def check(open_kind, plan, twice):
        n_case[0] += 1
        s = _Stream(stub.Session)
        try:
            hist = prompt(n_case[0], 6)
            op = dpb.DrafterOpen(
                session_id=f"fz{n_case[0]}", tenant="fuzz", history=hist, topk=k, history_topk=[7] * (k * 2)
            )
            first, want = _drafter_first(op, open_kind, k)
            if not _open(stub, s, first, want, dpb.DraftRequest(open=op) if twice else None, counts):
                return
            tree = None
            for how in plan:
                if how == "end":
                    s.send(dpb.DraftRequest(end_turn=dpb.EndTurn()))
                    continue
                step, field = _drafter_step(how, tree, k)
                if field:
                    _expect(lambda: s.send(dpb.DraftRequest(step=step)), IA, field, counts)
                    return
                tree = s.send(dpb.DraftRequest(step=step)).tree
                assert tree.tokens[0] == 9 and tree.parents[0] == -1 and len(tree.tokens) <= 6
                assert all(0 <= p < i for i, p in enumerate(tree.parents) if i)
                counts["OK"] = counts.get("OK", 0) + 1
            _expect(lambda: s.send(dpb.DraftRequest(open=op)), FP, "open", counts)
        finally:
            s.close()

    check()
    ch.close()
    print("drafter fuzz statuses:", counts)
    assert {"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "ABORTED"} <= set(counts), counts
    wait_until(lambda: not any(s.streaming for s in stack.drafter_sessions(0)), timeout=5, what="drafter streams ended")


def test_internal_oversized_message_is_refused(loop_thread):
    srv, svc = start_drafter(loop_thread, max_message_bytes=4096, internal_token=INTERNAL_TOKEN)
    try:
        with backend_channel(f"127.0.0.1:{srv.port}") as ch:
            s = _Stream(dgrpc.DrafterStub(ch).Session)
            with pytest.raises(grpc.RpcError) as e:
                s.send(dpb.DraftRequest(open=dpb.DrafterOpen(session_id="s", tenant="t", history=[7] * 5000)))
            assert e.value.code() == RE
            s.close()
            assert not svc.sessions
    finally:
        loop_thread.run(srv.stop(0))
