"""Function-calling sessions for ``racer bench-tools``: a JSONL format, its reader, and a converter
from the Berkeley Function Calling Leaderboard's (BFCL) files.

The format: one JSON object per line, one line per session (a conversation):

    {"tenant": "billing-agent",            # required: the tenant (an app and its tool set)
     "session": "q17",                      # optional: a name for the session (default: tenant/line)
     "tools": [{"name": ..., "description": ..., "parameters": {...}}, ...],   # optional
     "system": "You are ...",               # optional: text before the tools' documentation
     "turns": ["first user message", [{"role": "user", "content": "..."}], ...]}   # required

A turn is a user message (a string) or a list of chat messages (roles ``system``, ``user``,
``assistant``) that the conversation adds before the model answers; the model's own answer to each
turn becomes the assistant message before the next one. The session's system prompt is ``system``
followed by the tools' documentation (``render_system``: the JSON function docs under a fixed
preamble), rendered through the model's chat template as the first message. Lines are sessions in
the order they run; a tenant's sessions need not be adjacent. Blank lines are skipped.

BFCL (``from_bfcl``): one JSON object per line with ``id``, ``question`` (turns, each a list of
messages) and ``function`` (the JSON docs). Queries that share a function set are one tenant's
sessions; tenants come out ordered by their number of sessions (most first), then by first
appearance, so the first tenants are the ones with the most sessions to compare.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")
PREAMBLE = (
    "You are an assistant that answers by calling functions. Given the user's request and the "
    "functions below, reply with the function calls that fulfil it, in the form "
    "[func_name1(param1=value1, param2=value2), func_name2(param=value)], and nothing else. If no "
    "function fits, or a required parameter is missing, say so instead.\n"
    "Here are the functions you may call, in JSON format:\n"
)


@dataclass(frozen=True)
class ToolSession:
    tenant: str
    session: str
    system: str  # the whole system prompt (preamble and tools' documentation)
    turns: tuple[tuple[dict, ...], ...]  # per turn, the messages added before the model answers

    def first_messages(self) -> list[dict]:
        """The first turn's chat: the system prompt, then the first turn's messages."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.turns[0]]


def render_system(tools: list | None, system: str = "") -> str:
    """The system prompt of a session with ``tools``: ``system`` (or the preamble when there are tools
    and no ``system``) followed by the tools' JSON documentation, one function per block."""
    if not tools:
        return system
    head = system if system else PREAMBLE
    if not head.endswith("\n"):
        head += "\n"
    return head + json.dumps(tools, indent=4, ensure_ascii=False)


def _turn(raw, where: str) -> tuple[dict, ...]:
    if isinstance(raw, str):
        return ({"role": "user", "content": raw},)
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: a turn is a string or a non-empty list of messages")
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: a message is {{'role': one of {', '.join(ROLES)}, 'content': text}}")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def parse(rec, where: str) -> ToolSession:
    """One line's session; ``ValueError`` naming ``where`` and the field when it is not one."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object")
    tenant = rec.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"{where}: tenant: a non-empty string is required")
    tools = rec.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: tools: expected a list of JSON function docs")
    system = rec.get("system", "")
    if not isinstance(system, str):
        raise ValueError(f"{where}: system: expected a string")
    turns = rec.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: turns: a non-empty list is required")
    session = rec.get("session", "")
    if not isinstance(session, str):
        raise ValueError(f"{where}: session: expected a string")
    parsed = tuple(_turn(t, f"{where}: turns[{i}]") for i, t in enumerate(turns))
    return ToolSession(tenant, session or where, render_system(tools, system), parsed)


def read_jsonl(path: str) -> list[ToolSession]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            out.append(parse(rec, where))
    return out


def _bfcl_name(path: str) -> str:
    """A tenant name prefix from a BFCL file's name: ``BFCL_v4_live_simple.json`` -> ``live-simple``."""
    return os.path.basename(path).split(".")[0].removeprefix("BFCL_v4_").replace("_", "-")


def from_bfcl(lines: Iterable[str], name: str = "bfcl") -> list[dict]:
    """BFCL records (JSON lines) as records of this module's format: a tenant per distinct function
    set (``<name>-<n>``, numbered by first appearance), a session per query."""
    groups: dict[str, list[dict]] = {}
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            question, functions, qid = rec["question"], rec["function"], str(rec["id"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{name}:{line_no}: not a BFCL record ({e})") from None
        if not isinstance(question, list) or not question or not isinstance(functions, list):
            raise ValueError(f"{name}:{line_no}: question: a list of turns and function: a list are required")
        key = json.dumps(functions, sort_keys=True)
        groups.setdefault(key, []).append({"session": qid, "tools": functions, "turns": question})
    numbered = [(i, g) for i, g in enumerate(groups.values())]
    numbered.sort(key=lambda ig: (-len(ig[1]), ig[0]))
    return [dict(tenant=f"{name}-{i}", **rec) for i, g in numbered for rec in g]


def convert_bfcl(src: str, dst: str) -> int:
    """Writes ``src`` (a BFCL file) to ``dst`` in this module's format; the number of sessions."""
    with open(src, encoding="utf-8") as f:
        records = from_bfcl(f, _bfcl_name(src))
    for i, rec in enumerate(records):
        parse(rec, f"{src}: record {i}")  # what is written reads back
    with open(dst, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return len(records)


def load(path: str) -> list[ToolSession]:
    """Sessions from a file of this format, or from a BFCL file (recognized by its records' ``question``
    and ``function`` fields), converted on the fly."""
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        head = json.loads(first) if first else {}
    except ValueError:
        head = {}
    if isinstance(head, dict) and "question" in head and "function" in head:
        with open(path, encoding="utf-8") as f:
            return [parse(r, f"{path}: {r['session']}") for r in from_bfcl(f, _bfcl_name(path))]
    return read_jsonl(path)


def by_tenant(sessions: list[ToolSession]) -> dict[str, list[ToolSession]]:
    """The sessions grouped by tenant, tenants in order of first appearance."""
    out: dict[str, list[ToolSession]] = {}
    for s in sessions:
        out.setdefault(s.tenant, []).append(s)
    return out
