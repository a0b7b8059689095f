"""``racer bench-llama-cpp``: llama.cpp's ``llama-server`` and this project's stack side by side, on one
GGUF file (``--model``: the bundled one by default), through the same OpenAI requests.

Spec-Bench prompts (``--per-category`` of each category), one request at a time, greedy,
``--max-new-tokens`` tokens, prefill included; tok/s is new tokens over each request's wall time.
Every request is streamed: the time to its first token is the prefill (the prompt's tokens over it:
prefill tok/s), the rest is decoding (the tokens after the first over it: decode tok/s).

- llama.cpp: ``llama-server -m FILE`` (``--server``; ``scripts/build_llama_cpp.sh`` builds one),
  ``--threads`` threads, plain and with each ``--spec-types`` n-gram speculation, no prompt cache.
  Its own ``timings`` (prompt and decoding milliseconds, measured in the server) are reported too.
- racer: ``racer stack --model FILE`` (the three services, any free ports) in each of ``--dtypes``,
  modes ``off`` and ``racer`` (``--budget``), ``share: false`` (no tenant corpus), and no prefix
  cache (``RACER_PREFIX_CACHE=0``): with it, a prompt's second request (the other mode's) would skip
  most of its prefill, as llama.cpp's would with its prompt cache. The verifier gets its own CPUs as
  ``racer stack`` gives them (``--no-pin``: every CPU shared).

``--api``: ``chat`` (``/v1/chat/completions``, the file's chat template on both sides) or
``completions`` (``/v1/completions``, the prompt's text as it is); by default chat where the file
has a chat template (``tokenizer.chat_template``), completions for a base model.

``--schedule``:

- ``interleaved`` (the default): every server is started first; then each prompt goes to every
  one in turn (llama.cpp's modes, each dtype's ``off`` and ``racer``), the order rotated from prompt
  to prompt, so that a shared machine's drift over the run weighs on every figure alike. Servers
  that are up but idle still share the machine: their memory, their threads' wake-ups, whatever the
  last request left running.
- ``alone``: one server up at a time, every prompt (a stack's two modes alternating), then it stops
  and the next starts: what each makes on a machine to itself, with the drift between them.
- ``both``: ``alone``, then ``interleaved``, and the two side by side.

Reported: tok/s over all requests and the median, each against llama.cpp plain, and how many
answers (their text) equal the reference: racer's ``off`` in the same dtype for ``racer`` (the
exactness contract), the first dtype's racer ``off`` for the others (a check that both compute the
same model; 8-bit activations are rounded alike but summed in another order, so a near tie can
differ). Per server: its start-up (process start to serving; a stack's first conversion of the file
is timed apart), and its memory at the end of its prompts (resident, of which mapped from files,
and the peak; a stack's three processes summed) against the file's size.

    racer bench-llama-cpp --server ~/.cache/racer/llama.cpp/build/bin/llama-server --per-category 2
    racer bench-llama-cpp --server ... --model ~/models/x.Q4_K_M.gguf --dtypes auto --schedule both
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.text import DEFAULT_SYSTEM

from ..prompts import DEFAULT_PROMPTS, load_spec_bench
from .harness import table

SCHEDULES = ("interleaved", "alone", "both")
APIS = ("auto", "chat", "completions")


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    tokens: int  # new tokens
    seconds: float  # the request's wall time, sent to last byte
    first: float  # seconds to the first new token (the prefill, and the first step)
    server: dict = field(default_factory=dict)  # llama.cpp's own timings (prompt_ms, predicted_ms, ...)


@dataclass
class Server:
    """A server once it is up: its arms (name, ask), its start-up and its processes (for their memory)."""

    name: str
    arms: list[tuple[str, Callable[[str], Answer]]]
    startup: float
    pids: list[int]
    conversion: float = 0.0  # a stack's resolve_model_dir before it started (the first time: the conversion)
    memory: dict = field(default_factory=dict)


# --- the file --------------------------------------------------------------------------------------


def gguf_file(model: str) -> Path:
    """The GGUF file ``--model`` names: ``default`` (the bundled file), a ``.gguf`` file, or a
    directory holding exactly one (a multimodal projector, ``mmproj*``, aside)."""
    from verifier.model import DEFAULT_MODEL, default_gguf_path

    if model == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_dir():
        found = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
        if len(found) != 1:
            raise ValueError(f"--model {model}: a directory for this benchmark holds one .gguf file, not {len(found)}")
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"--model {model}: no such GGUF file")
    return path


def racer_model(model: str, path: Path) -> str:
    """What the stacks get as ``--model``: ``default`` for the bundled file (its prior and its cached
    conversion), the path itself for any other."""
    from verifier.model import DEFAULT_MODEL, default_gguf_path

    if model == DEFAULT_MODEL or path.resolve() == default_gguf_path().resolve():
        return DEFAULT_MODEL
    return str(path)


def has_chat_template(path: Path) -> bool:
    """Whether the file's metadata holds ``tokenizer.chat_template``."""
    from gguf import GGUFReader

    return GGUFReader(str(path)).get_field("tokenizer.chat_template") is not None


def choose_api(api: str, path: Path) -> str:
    if api != "auto":
        return api
    return "chat" if has_chat_template(path) else "completions"


# --- requests ---------------------------------------------------------------------------------------


def _get(url: str, key: str | None = None) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _stream(url: str, body: dict, key: str | None = None) -> Answer:
    """POSTs ``body`` as a stream (server-sent events) and reads it to its end: the text, the usage,
    the time to the first chunk that carries a new token, and llama.cpp's ``timings`` where sent."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    parts: list[str] = []
    usage: dict = {}
    timings: dict = {}
    first = None
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    raise RuntimeError(f"{url}: {ev['error']}")
                usage = ev.get("usage") or usage
                timings = ev.get("timings") or timings
                for choice in ev.get("choices") or ():
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content") or ""
                    if first is None and (text or choice.get("token_ids")):
                        first = time.perf_counter() - t0
                    parts.append(text)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: {e.code} {e.read().decode(errors='replace')[:500]}") from None
    seconds = time.perf_counter() - t0
    tokens = int(usage.get("completion_tokens", timings.get("predicted_n", 0)))
    prompt = int(usage.get("prompt_tokens", timings.get("prompt_n", 0)))
    return Answer("".join(parts), prompt, tokens, seconds, seconds if first is None else first, timings)


def _payload(api: str, text: str) -> dict:
    if api == "chat":
        return {"messages": [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": text}]}
    return {"prompt": text}


def _endpoint(api: str) -> str:
    return "/chat/completions" if api == "chat" else "/completions"


# --- memory -----------------------------------------------------------------------------------------


def _status(pid: int) -> dict[str, int]:
    """/proc/PID/status's memory lines, in bytes (empty for a process that is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def memory(pids: list[int]) -> dict[str, int]:
    """The processes' resident memory summed: ``rss``, ``file`` (mapped from files: a mapped GGUF
    file's pages count here, and once per process that maps them) and ``peak`` (their VmHWM)."""
    total = {"rss": 0, "file": 0, "peak": 0}
    for pid in pids:
        s = _status(pid)
        total["rss"] += s.get("VmRSS", 0)
        total["file"] += s.get("RssFile", 0)
        total["peak"] += s.get("VmHWM", 0)
    return total


def _children() -> set[int]:
    """This process's child processes now."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == me:
                out.add(int(entry))
    return out


# --- servers ----------------------------------------------------------------------------------------


def _llama_server(server: str, path: Path, threads: int, extra: list[str]):
    """llama-server on ``path``, listening on a port it picks (read back from its log)."""
    cmd = [server, "-m", str(path), "--host", "127.0.0.1", "--port", "0"]
    cmd += ["-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1", "--no-webui", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # "... server is listening on http://127.0.0.1:PORT"
        if "listening on http://" in line:
            url = line.split("listening on ", 1)[1].split()[0].rstrip("/")
            break
    else:
        raise RuntimeError(f"{' '.join(cmd)} exited ({proc.wait()}) before it listened")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not become healthy")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def _llama_servers(args, path: Path, api: str) -> list[tuple[str, Callable]]:
    """A starter per llama.cpp mode (plain, then each ``--spec-types``): each starts its
    ``llama-server`` inside an exit stack and returns the ``Server``."""

    def starter(name: str, extra: list[str]):
        def start(up: contextlib.ExitStack) -> Server:
            t0 = time.perf_counter()
            proc, url = _llama_server(args.server, path, args.threads, extra)
            startup = time.perf_counter() - t0
            up.callback(_stop, proc)

            def ask(text: str) -> Answer:
                body = _payload(api, text) | {"max_tokens": args.max_new_tokens, "temperature": 0.0, "top_k": 1}
                return _stream(url + "/v1" + _endpoint(api), body | {"cache_prompt": False})

            label = f"llama.cpp {name}"
            return Server(label, [(label, ask)], startup, [proc.pid])

        return start

    modes = [("plain", [])] + [(s, ["--spec-type", s]) for s in args.spec_types.split(",") if s]
    return [(f"llama.cpp {name}", starter(name, extra)) for name, extra in modes]


def _racer_servers(args, model: str, api: str) -> list[tuple[str, Callable]]:
    """A starter per ``--dtypes``: a ``racer stack`` whose arms send a prompt in mode ``off`` or
    ``racer``."""
    from verifier.model import resolve_model_dir

    from .. import stack

    def starter(dtype: str):
        def start(up: contextlib.ExitStack) -> Server:
            t0 = time.perf_counter()
            resolve_model_dir(model)  # the first time: the file converted (cached), before the stack's clock
            conversion = time.perf_counter() - t0
            no_cache = {"RACER_PREFIX_CACHE": "0"}  # each request prefills its whole prompt, as llama.cpp's do
            before = _children()
            t0 = time.perf_counter()
            target = up.enter_context(
                stack.running(model=model, dtype=dtype, any_ports=True, http_port=1, pin=not args.no_pin, env=no_cache)
            )
            startup = time.perf_counter() - t0
            pids = sorted(_children() - before)
            base, key = f"http://127.0.0.1:{target.http_port}/v1", stack.client_key()
            served = _get(base + "/models", key)["data"][0]["id"]
            arms = []
            for mode in ("off", "racer"):

                def ask(text: str, mode=mode) -> Answer:
                    body = _payload(api, text) | {"model": served, "max_tokens": args.max_new_tokens}
                    body |= {"share": False, "speculation": {"mode": mode, "budget": args.budget}}
                    return _stream(base + _endpoint(api), body | {"return_token_ids": True}, key)

                arms.append((f"racer {dtype} {mode}", ask))
            return Server(f"racer {dtype}", arms, startup, pids, conversion)

        return start

    return [(f"racer {dtype}", starter(dtype)) for dtype in args.dtypes.split(",") if dtype]


# --- schedules --------------------------------------------------------------------------------------

Results = dict[str, list[Answer]]


def _ask_all(arms, prompts, out: Results) -> None:
    """Each prompt to every arm in turn, the order rotated prompt by prompt. The first prompt warms
    every arm up and is not counted."""
    for i, p in enumerate([prompts[0], *prompts]):
        for name, ask in arms[i % len(arms) :] + arms[: i % len(arms)]:
            a = ask(p.text)
            if i:
                out.setdefault(name, []).append(a)


def interleaved(starters, prompts) -> tuple[Results, list[Server]]:
    """Every server up at once, then each prompt sent to every arm in turn: a shared machine's speed
    drifts over minutes, and this puts the same drift into every arm's figures."""
    out: Results = {}
    with contextlib.ExitStack() as up:
        servers = [start(up) for _, start in starters]
        _ask_all([arm for s in servers for arm in s.arms], prompts, out)
        for s in servers:
            s.memory = memory(s.pids)
    return out, servers


def alone(starters, prompts) -> tuple[Results, list[Server]]:
    """One server at a time: started, every prompt (its arms in turn), its memory read, stopped."""
    out: Results = {}
    servers = []
    for _, start in starters:
        with contextlib.ExitStack() as up:
            s = start(up)
            _ask_all(s.arms, prompts, out)
            s.memory = memory(s.pids)
            servers.append(s)
    return out, servers


# --- report -----------------------------------------------------------------------------------------


def _rate(runs: list[Answer]) -> float:
    return sum(a.tokens for a in runs) / sum(a.seconds for a in runs)


def _prefill(runs: list[Answer]) -> float:
    return sum(a.prompt_tokens for a in runs) / sum(a.first for a in runs)


def _decode(runs: list[Answer]) -> float:
    spent = sum(a.seconds - a.first for a in runs)
    return sum(max(a.tokens - 1, 0) for a in runs) / spent if spent > 0 else float("nan")


def _server_timings(runs: list[Answer]) -> str:
    """llama.cpp's own prefill and decoding tok/s, from the ``timings`` it sends."""
    t = [a.server for a in runs if a.server.get("prompt_ms") and a.server.get("predicted_ms")]
    if len(t) < len(runs):
        return "-"
    pre = sum(x["prompt_n"] for x in t) / sum(x["prompt_ms"] for x in t) * 1e3
    dec = sum(x["predicted_n"] for x in t) / sum(x["predicted_ms"] for x in t) * 1e3
    return f"{pre:.0f} / {dec:.1f}"


def speed_table(results: Results, reference: str) -> str:
    base = results.get("llama.cpp plain")
    rows = []
    for name, runs in results.items():
        if name.startswith("racer") and name.endswith(" racer"):
            ref_name = name[: -len("racer")] + "off"
        else:
            ref_name = reference if name != reference else ""
        ref = results.get(ref_name)
        what = ref_name.removeprefix("racer ") if ref_name.endswith(" off") and name.startswith("racer") else ref_name
        equal = "-" if ref is None else f"{sum(a.text == b.text for a, b in zip(runs, ref))}/{len(runs)} {what}"
        med = statistics.median(a.tokens / a.seconds for a in runs)
        x = f"{_rate(runs) / _rate(base):.2f}" if base else "-"
        ttft = statistics.median(a.first for a in runs) * 1e3
        rows.append(
            (
                name,
                f"{_rate(runs):.1f}",
                f"{med:.1f}",
                x,
                f"{ttft:.0f}",
                f"{_prefill(runs):.0f}",
                f"{_decode(runs):.1f}",
                _server_timings(runs),
                equal,
            )
        )
    head = ["server", "tok/s", "median tok/s", "x llama.cpp plain", "median TTFT ms", "prefill tok/s"]
    head += ["decode tok/s", "llama.cpp's timings: prefill / decode tok/s", "equal"]
    return table(head, rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def server_table(servers: list[Server], file_size: int) -> str:
    rows = []
    for s in servers:
        m = s.memory
        rows.append(
            (
                s.name,
                f"{s.startup:.1f}",
                f"{s.conversion:.1f}" if s.name.startswith("racer") else "-",
                _mib(m["rss"]),
                _mib(m["file"]),
                _mib(m["peak"]),
                f"{m['rss'] / file_size:.1f}",
            )
        )
    head = ["server", "start-up s", "conversion s (cached after the first)", "RSS MiB", "of which files MiB"]
    head += ["peak RSS MiB", "RSS / file"]
    return table(head, rows) + f"\n\nthe file: {_mib(file_size)} MiB"


def main(args) -> int:
    path = gguf_file(args.model)
    api = choose_api(args.api, path)
    model = racer_model(args.model, path)
    prompts = load_spec_bench(args.prompts or DEFAULT_PROMPTS, args.per_category)
    starters = (_llama_servers(args, path, api) if args.server else []) + _racer_servers(args, model, api)
    dtypes = [d for d in args.dtypes.split(",") if d]
    reference = f"racer {dtypes[0]} off" if dtypes else "llama.cpp plain"
    schedules = ["alone", "interleaved"] if args.schedule == "both" else [args.schedule]
    runs = {}
    for schedule in schedules:
        results, servers = (alone if schedule == "alone" else interleaved)(starters, prompts)
        runs[schedule] = results
        print(
            f"\n{path.name}, {schedule}: {len(prompts)} Spec-Bench prompts through /v1{_endpoint(api)}, "
            f"{args.max_new_tokens} tokens, greedy, one at a time, prefill included; llama.cpp {args.threads} threads"
        )
        print(speed_table(results, reference))
        print()
        print(server_table(servers, path.stat().st_size))
    if len(runs) == 2:
        print("\ntok/s (prefill tok/s, decode tok/s): each server alone and interleaved")
        rows = []
        for name in runs["alone"]:
            a, b = runs["alone"][name], runs["interleaved"][name]
            rows.append(
                (
                    name,
                    f"{_rate(a):.1f} ({_prefill(a):.0f}, {_decode(a):.1f})",
                    f"{_rate(b):.1f} ({_prefill(b):.0f}, {_decode(b):.1f})",
                    f"{_rate(b) / _rate(a):.2f}",
                )
            )
        print(table(["server", "alone", "interleaved", "interleaved / alone"], rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            recs = [
                {
                    "schedule": schedule,
                    "server": name,
                    "question_id": p.question_id,
                    "text": a.text,
                    "prompt_tokens": a.prompt_tokens,
                    "tokens": a.tokens,
                    "seconds": a.seconds,
                    "first_token_seconds": a.first,
                    "server_timings": a.server,
                }
                for schedule, results in runs.items()
                for name, answers in results.items()
                for p, a in zip(prompts, answers)
            ]
            json.dump(recs, f, indent=1)
    return 0
