"""Per-tenant quotas kept in the session store, so every gateway replica counts the same sessions.

Three quotas per tenant: sessions kept, tokens stored (a turn reserves its history plus its
``max_new_tokens`` when it starts; the record's length replaces the reservation when it is saved)
and turns running at once. Defaults and per-tenant overrides come from a tenant-limits file (TOML
or JSON, see ``load_tenant_limits``); 0 means no limit.

In Redis a tenant's counts are a sorted set of its sessions (scored by when their record expires),
a hash of the tokens each holds, and a sorted set of its running turns (scored by when their lease
expires, renewed while the turn runs): a session whose record expires, or a turn whose gateway died,
stops counting on its own. Admission is one Lua script, so two gateways cannot both take the last
slot. The in-memory store (one process) keeps the same counts in dicts.
"""

from __future__ import annotations

import json
import time
import tomllib
from dataclasses import asdict, dataclass, fields
from typing import Annotated

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from common.errors import Abort, Status

from . import metrics as M
from .admission import TurnsFull
from .auth import TENANT

Count = Annotated[int, Field(ge=0, strict=True)]  # strict: true is not 1, 1.0 is not an integer


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class Quota:
    sessions: Count = 0  # sessions kept (records in the store); 0: no limit
    tokens: Count = 0  # tokens of all the tenant's session histories, reservations of running turns included
    turns: Count = 0  # turns running at once, on all gateways
    # The tenant corpus (drafters): its bound in tokens (0: the drafters' default) and whether the
    # tenant shares at all (false: its sessions neither draft from nor add to a corpus).
    corpus_tokens: Count = 0
    share: Annotated[bool, Field(strict=True)] = True
    # The verifiers' prefix cache: tenants with the same group share cached prompt blocks (one
    # organisation's tenants, say); empty (the default): the tenant's blocks are its own.
    prefix_group: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.@-]{0,64}$")] = ""


_KEYS = tuple(f.name for f in fields(Quota))
_QUOTA = TypeAdapter(Quota)


@dataclass(frozen=True)
class TenantLimits:
    default: Quota = Quota()
    tenants: tuple[tuple[str, Quota], ...] = ()  # per-tenant overrides

    def of(self, tenant: str) -> Quota:
        return dict(self.tenants).get(tenant, self.default)


def _quota(d: object, base: Quota, where: str) -> Quota:
    """A table of the file: ``base`` with the table's keys on top, each checked."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a table of {', '.join(_KEYS)}")
    try:
        return _QUOTA.validate_python({**asdict(base), **d})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        key = ".".join(map(str, err["loc"]))
        if err["type"] == "unexpected_keyword_argument":
            raise ValueError(f"{where}: unknown key {key}; expected {', '.join(_KEYS)}") from None
        raise ValueError(f"{where}.{key}: {err['input']!r}: {err['msg']} (0: no limit)") from None


def load_tenant_limits(path: str, default: Quota = Quota()) -> TenantLimits:
    """Quotas from a file; ``default`` (the settings) fills what the file leaves out. The file::

        [default]            # every tenant without its own table
        sessions = 256
        tokens = 1000000
        turns = 16

        [tenants.acme]       # overrides, key by key, on top of [default]
        turns = 4
        prefix_group = "acme"  # shares prefix-cache blocks with the other tenants of group "acme"

    (or the same structure in JSON when the name ends in ``.json``)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        d = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(d, dict) or set(d) - {"default", "tenants"}:
        raise ValueError(f"{path}: expected only the tables 'default' and 'tenants'")
    base = _quota(d.get("default", {}), default, f"{path}: default")
    tenants = d.get("tenants", {})
    if not isinstance(tenants, dict):
        raise ValueError(f"{path}: tenants: expected a table of tenant tables")
    out = []
    for name, q in tenants.items():
        if not TENANT.fullmatch(name):
            raise ValueError(f"{path}: tenants.{name}: expected 1-64 of A-Z a-z 0-9 _ . @ -")
        out.append((name, _quota(q, base, f"{path}: tenants.{name}")))
    return TenantLimits(base, tuple(out))


def quota_keys(tenant: str) -> tuple[str, str, str]:
    p = f"racer:quota:{tenant}:"
    return p + "sessions", p + "tokens", p + "turns"


# KEYS: sessions (zset sid -> expiry), tokens (hash sid -> tokens), turns (zset turn -> expiry), the record
# ARGV: now, sid, need, turn id, turn expiry, session expiry, max sessions, max tokens, max turns, key ttl ms,
# '1' if the session is new, '1' if it is kept ('0': a one-call session, closed after its turn: it never
# counts as kept, and its tokens count under 'turn:<turn id>' while the turn runs)
# Returns {0, 0} when admitted, else {1 turns | 2 sessions | 3 tokens, the count that is full} or {4, 0}: an
# existing session whose record is gone (closed since the turn read it). {2, n, expiry}: the first kept
# session expires then, unless it is used again.
_PRUNE = """
local now = tonumber(ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
for _, s in ipairs(gone) do redis.call('HDEL', KEYS[2], s) end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now) end
local ended = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. now)
for _, t in ipairs(ended) do redis.call('HDEL', KEYS[2], 'turn:' .. t) end
if #ended > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. now) end
"""
_ADMIT = (
    _PRUNE
    + """
local sid, need = ARGV[2], tonumber(ARGV[3])
local max_s, max_t, max_c = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local kept = ARGV[12] == '1'
if ARGV[11] ~= '1' and redis.call('EXISTS', KEYS[4]) == 0 then return {4, 0} end
local turns = redis.call('ZCARD', KEYS[3])
if max_c > 0 and turns >= max_c then return {1, turns} end
if kept and not redis.call('ZSCORE', KEYS[1], sid) then
  local n = redis.call('ZCARD', KEYS[1])
  if max_s > 0 and n >= max_s then
    local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {2, n, first[2]}
  end
end
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do total = total + tonumber(v) end
total = total - tonumber(redis.call('HGET', KEYS[2], sid) or '0')
if max_t > 0 and total + need > max_t then return {3, total} end
if kept then
  redis.call('ZADD', KEYS[1], 'GT', ARGV[6], sid)
  redis.call('HSET', KEYS[2], sid, need)
else
  redis.call('HSET', KEYS[2], 'turn:' .. ARGV[4], need)
end
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[4])
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[10]) end
return {0, 0}
"""
)
# ARGV: turn id, turn expiry, key ttl ms, sid. A running turn's session counts at least as long as
# its lease: a new session whose gateway died stops counting when the lease would have expired.
_RENEW = """
if redis.call('ZADD', KEYS[3], 'XX', 'CH', ARGV[2], ARGV[1]) == 1 then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  redis.call('ZADD', KEYS[1], 'XX', 'GT', ARGV[2], ARGV[4])
end
return 1
"""
# ARGV: turn id, sid, outcome ('saved' | 'new' | 'kept' | 'call': a one-call session's turn), tokens (saved or
# restored), session expiry, key ttl ms,
# the turn's reservation (a 'kept' turn restores the count only if no later turn changed it)
_END = """
redis.call('ZREM', KEYS[3], ARGV[1])
local sid = ARGV[2]
if ARGV[3] == 'call' then
  redis.call('HDEL', KEYS[2], 'turn:' .. ARGV[1])
  return 1
end
if not redis.call('ZSCORE', KEYS[1], sid) then return 0 end
if ARGV[3] == 'kept' and redis.call('HGET', KEYS[2], sid) ~= ARGV[7] then return 0 end
if ARGV[3] == 'new' then
  redis.call('ZREM', KEYS[1], sid)
  redis.call('HDEL', KEYS[2], sid)
  return 1
end
redis.call('HSET', KEYS[2], sid, ARGV[4])
if ARGV[3] == 'saved' then redis.call('ZADD', KEYS[1], ARGV[5], sid) end
for i = 1, 2 do redis.call('PEXPIRE', KEYS[i], ARGV[6]) end
return 1
"""
_FORGET = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""
_USAGE = (
    _PRUNE
    + """
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do total = total + tonumber(v) end
return {redis.call('ZCARD', KEYS[1]), total, redis.call('ZCARD', KEYS[3])}
"""
)


@dataclass
class _Tenant:  # the in-memory store's counts of one tenant
    sessions: dict[str, float]  # sid -> expiry (unix s)
    tokens: dict[str, int]
    turns: dict[str, float]  # turn id -> expiry

    def prune(self, now: float) -> None:
        for sid in [s for s, exp in self.sessions.items() if exp < now]:
            del self.sessions[sid]
            self.tokens.pop(sid, None)
        for t in [t for t, exp in self.turns.items() if exp < now]:
            del self.turns[t]
            self.tokens.pop(f"turn:{t}", None)


def _refuse(code: int, n: int, first: list, now: float, tenant: str, session_id: str, need: int, q: Quota) -> None:
    """Raises what an admission's ``code`` means (0: admitted, nothing): 1 the turns quota is full,
    2 the sessions quota (``first``: when the idlest session expires), 3 the tokens quota, 4 the
    session is gone; ``n``: the count that is full."""
    if code == 4:
        raise Abort(Status.NOT_FOUND, f"session_id {session_id!r}: no such session (it was closed)", field="session_id")
    if code > 1:  # a full turns quota is counted by the queue, if it refuses the turn
        M.QUOTA_REFUSALS.labels(("turns", "sessions", "tokens")[code - 1]).inc()
    if code == 1:  # the turn may wait for a slot (admission.TurnQueue)
        raise TurnsFull(
            f"tenant {tenant!r}: {n} turns are running on the gateways, the quota is turns={q.turns}", q.turns
        )
    if code == 2:
        wait = max(1.0, float(first[0]) - now) if first else None
        raise Abort(
            Status.RESOURCE_EXHAUSTED,
            f"tenant {tenant!r}: {n} sessions are kept, the quota is sessions={q.sessions}; close one you no "
            "longer continue (CloseSession, DELETE /v1/sessions/ID), or send this request without a session "
            "(a one-call session is not kept)"
            + (f", or retry after {wait:.0f} s, when the idlest one expires unless it is used" if wait else ""),
            retry_after=wait,
        )
    if code == 3:
        raise Abort(
            Status.RESOURCE_EXHAUSTED,
            f"tenant {tenant!r}: the sessions hold {n} tokens and this turn may take the session to {need} "
            f"(history + max_new_tokens), the quota is tokens={q.tokens}; close sessions or ask for fewer "
            "max_new_tokens",
        )


class Quotas:
    """The quotas of every tenant, counted in ``store`` (through ``call``: the records' retried calls)."""

    def __init__(self, store, limits: TenantLimits, ttl_s: float, call, clock=time.time):
        self._store = store
        self.limits = limits
        self.ttl_s = ttl_s  # a session record's TTL: how long an idle session counts
        self._call = call
        self._clock = clock  # seconds, shared by every gateway (entries expire by it): wall-clock time
        script = getattr(store, "script", None)
        if script is not None:
            self._admit, self._renew, self._end = script(_ADMIT), script(_RENEW), script(_END)
            self._forget, self._usage = script(_FORGET), script(_USAGE)
            self._mem: dict[str, _Tenant] | None = None
        else:
            self._mem = {}

    def _t(self, tenant: str) -> _Tenant:
        t = self._mem.setdefault(tenant, _Tenant({}, {}, {}))
        t.prune(self._clock())
        return t

    async def admit(
        self,
        tenant: str,
        session_id: str,
        need: int,
        turn_id: str,
        lease_s: float,
        new: bool = True,
        record: str = "",
        kept: bool = True,
    ) -> None:
        """Counts a starting turn that may grow the session to ``need`` tokens; RESOURCE_EXHAUSTED
        (nothing counted) when a quota of the tenant is full (``TurnsFull`` for the turns quota: the
        turn may wait), NOT_FOUND when an existing session's ``record`` (its store key) is gone:
        closed since the turn read it.

        A new session counts as long as its turn's lease (renewed with it) until a save gives it the
        record's TTL: a turn whose gateway died leaves nothing counted past its lease. ``kept``
        False: a one-call session (closed after its turn) is no kept session: only its turn and
        the tokens it reserves count, until the turn ends (``end(..., 'call', ...)``)."""
        q = self.limits.of(tenant)
        now = self._clock()
        expiry = now + lease_s if new else now + self.ttl_s + lease_s
        if self._mem is None:
            args = [now, session_id, need, turn_id, now + lease_s, expiry]
            args += [q.sessions, q.tokens, q.turns, int((self.ttl_s + lease_s) * 1000), "1" if new else "0"]
            args.append("1" if kept else "0")
            code, n, *first = await self._call("quota", self._admit, (*quota_keys(tenant), record), args)
        else:
            # One process: nothing runs between this check and the admission (no await in between).
            if not new and (not record or await self._call("get", self._store.get, record) is None):
                code, n, first = 4, 0, []
            else:
                t = self._t(tenant)
                code, n = self._admit_memory(t, q, now, session_id, need, turn_id, lease_s, expiry, kept)
                first = [min(t.sessions.values())] if code == 2 else []
        _refuse(code, n, first, now, tenant, session_id, need, q)

    def _admit_memory(
        self, t: _Tenant, q: Quota, now, sid, need, turn_id, lease_s, expiry, kept: bool
    ) -> tuple[int, int]:
        if q.turns and len(t.turns) >= q.turns:
            return 1, len(t.turns)
        if kept and sid not in t.sessions and q.sessions and len(t.sessions) >= q.sessions:
            return 2, len(t.sessions)
        total = sum(t.tokens.values()) - t.tokens.get(sid, 0)
        if q.tokens and total + need > q.tokens:
            return 3, total
        if kept:
            t.sessions[sid] = max(t.sessions.get(sid, 0.0), expiry)
            t.tokens[sid] = need
        else:
            t.tokens[f"turn:{turn_id}"] = need
        t.turns[turn_id] = now + lease_s
        return 0, 0

    async def renew(self, tenant: str, session_id: str, turn_id: str, lease_s: float) -> None:
        now = self._clock()
        if self._mem is None:
            args = [turn_id, now + lease_s, int((self.ttl_s + lease_s) * 1000), session_id]
            await self._call("quota", self._renew, quota_keys(tenant), args, retry=False)
            return
        t = self._t(tenant)
        if turn_id in t.turns:
            t.turns[turn_id] = now + lease_s
            if session_id in t.sessions:
                t.sessions[session_id] = max(t.sessions[session_id], now + lease_s)

    async def end(self, tenant: str, session_id: str, turn_id: str, outcome: str, tokens: int, need: int) -> None:
        """The turn (which reserved ``need``) ended: ``outcome`` 'saved' (the session now holds
        ``tokens``), 'kept' (not saved: back to ``tokens``, unless a later turn of the session changed
        the count), 'new' (not saved, and the session never existed: it stops counting) or 'call' (a
        one-call session's turn: its reservation goes, whether it was saved or not)."""
        now = self._clock()
        if self._mem is None:
            args = [turn_id, session_id, outcome, tokens, now + self.ttl_s, int(self.ttl_s * 1000), need]
            await self._call("quota", self._end, quota_keys(tenant), args)
            return
        t = self._t(tenant)
        t.turns.pop(turn_id, None)
        if outcome == "call":
            t.tokens.pop(f"turn:{turn_id}", None)
            return
        if session_id not in t.sessions or (outcome == "kept" and t.tokens.get(session_id) != need):
            return
        if outcome == "new":
            del t.sessions[session_id]
            t.tokens.pop(session_id, None)
            return
        t.tokens[session_id] = tokens
        if outcome == "saved":
            t.sessions[session_id] = now + self.ttl_s

    async def forget(self, tenant: str, session_id: str) -> None:
        """The session was closed: it stops counting."""
        if self._mem is None:
            await self._call("quota", self._forget, quota_keys(tenant), [session_id])
            return
        t = self._t(tenant)
        t.sessions.pop(session_id, None)
        t.tokens.pop(session_id, None)

    async def usage(self, tenant: str) -> tuple[int, int, int]:
        """(sessions kept, tokens held or reserved, turns running) of ``tenant`` now."""
        if self._mem is None:
            args = [self._clock()]
            s, tok, turns = await self._call("quota", self._usage, quota_keys(tenant), args, retry=False)
            return int(s), int(tok), int(turns)
        t = self._t(tenant)
        return len(t.sessions), sum(t.tokens.values()), len(t.turns)
