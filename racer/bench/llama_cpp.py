"""``racer bench-llama-cpp``: llama.cpp's ``llama-server`` and this project's stack side by side, on the
bundled model's GGUF file, through the same OpenAI chat requests.

Spec-Bench prompts (``--per-category`` of each category), one request at a time, greedy,
``--max-new-tokens`` tokens, prefill included; tok/s is new tokens over each request's wall time.

- llama.cpp: ``llama-server`` (``--server``; ``scripts/build_llama_cpp.sh`` builds one) on the same
  file, ``--threads`` threads, plain and with each ``--spec-types`` n-gram speculation, no prompt
  cache.
- racer: ``racer stack`` (the three services, any free ports) in each of ``--dtypes``, modes ``off``
  and ``racer`` (``--budget``), ``share: false`` (no tenant corpus), and no
  prefix cache (``RACER_PREFIX_CACHE=0``): with it, a prompt's second request (the other mode's)
  would skip most of its prefill, as llama.cpp's would with its prompt cache. The verifier gets its
  own CPUs as ``racer stack`` gives them (``--no-pin``: every CPU shared).

Every server is started first; then each prompt goes to every one in turn (llama.cpp's modes, each
dtype's ``off`` and ``racer``), the order rotated from prompt to prompt, so that a shared machine's
drift over the run weighs on every figure alike.

Reported: tok/s over all requests and the median, each against llama.cpp plain, and how many
answers (their text) equal the reference: racer's ``off`` in the same dtype for ``racer`` (the
exactness contract), racer ``gguf`` ``off`` for the others (a check that both compute the same
model; 8-bit activations are rounded alike but summed in another order, so a near tie can differ).

    racer bench-llama-cpp --server ~/.cache/racer/llama.cpp/build/bin/llama-server --per-category 2
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from common.text import DEFAULT_SYSTEM

from ..prompts import DEFAULT_PROMPTS, load_spec_bench
from .harness import table


def _post(url: str, body: dict, key: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: {e.code} {e.read().decode(errors='replace')[:500]}") from None


def _get(url: str, key: str | None = None) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _llama_server(server: str, threads: int, extra: list[str]):
    """llama-server on the bundled file, listening on a port it picks (read back from its log)."""
    from verifier.model import default_gguf_path

    cmd = [server, "-m", str(default_gguf_path()), "--host", "127.0.0.1", "--port", "0"]
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
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not become healthy")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def _messages(text: str) -> list[dict]:
    return [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": text}]


def _text(r: dict) -> str:
    return r["choices"][0]["message"]["content"]


def _llama_arms(args, servers: contextlib.ExitStack) -> list[tuple[str, Callable[[str], dict]]]:
    """A ``llama-server`` per mode (plain, then each ``--spec-types``), all started before the first
    request; an arm sends a prompt to one of them."""
    arms = []
    for name, extra in [("plain", [])] + [(s, ["--spec-type", s]) for s in args.spec_types.split(",") if s]:
        proc, url = _llama_server(args.server, args.threads, extra)
        servers.callback(_stop, proc)

        def ask(text: str, url=url) -> dict:
            body = {"messages": _messages(text), "max_tokens": args.max_new_tokens, "temperature": 0.0}
            return _post(url + "/v1/chat/completions", body | {"top_k": 1, "cache_prompt": False})

        arms.append((f"llama.cpp {name}", ask))
    return arms


def _racer_arms(args, stacks: contextlib.ExitStack) -> list[tuple[str, Callable[[str], dict]]]:
    """A ``racer stack`` per ``--dtypes``; an arm sends a prompt to one of them in mode ``off`` or
    ``racer``."""
    from .. import stack

    arms = []
    for dtype in args.dtypes.split(","):
        no_cache = {"RACER_PREFIX_CACHE": "0"}  # each request prefills its whole prompt, as llama.cpp's do
        target = stacks.enter_context(
            stack.running(dtype=dtype, any_ports=True, http_port=1, pin=not args.no_pin, env=no_cache)
        )
        base, key = f"http://127.0.0.1:{target.http_port}/v1", stack.client_key()
        model = _get(base + "/models", key)["data"][0]["id"]
        for mode in ("off", "racer"):

            def ask(text: str, base=base, key=key, model=model, mode=mode) -> dict:
                body = {"model": model, "messages": _messages(text), "max_tokens": args.max_new_tokens}
                body |= {"share": False, "speculation": {"mode": mode, "budget": args.budget}, "return_token_ids": True}
                return _post(base + "/chat/completions", body, key)

            arms.append((f"racer {dtype} {mode}", ask))
    return arms


def _runs(args, prompts) -> dict[str, list[tuple[str, int, float]]]:
    """Every server up at once (idle, they take no CPU), then each prompt sent to every arm in turn,
    the order rotated prompt by prompt: a shared machine's speed drifts over minutes, and this puts
    the same drift into every arm's figures. The first prompt warms every arm up and is not counted."""
    with contextlib.ExitStack() as up:
        arms = (_llama_arms(args, up) if args.server else []) + _racer_arms(args, up)
        out: dict[str, list[tuple[str, int, float]]] = {name: [] for name, _ in arms}
        for i, p in enumerate([prompts[0], *prompts]):
            for name, ask in arms[i % len(arms) :] + arms[: i % len(arms)]:
                t0 = time.perf_counter()
                r = ask(p.text)
                dt = time.perf_counter() - t0
                if i:
                    out[name].append((_text(r), int(r["usage"]["completion_tokens"]), dt))
    return out


def main(args) -> int:
    prompts = load_spec_bench(args.prompts or DEFAULT_PROMPTS, args.per_category)
    results = _runs(args, prompts)
    base = results.get("llama.cpp plain")
    rate = {k: sum(n for _, n, _ in v) / sum(s for _, _, s in v) for k, v in results.items()}
    ref_gguf = results.get("racer gguf off")
    rows = []
    for name, runs in results.items():
        if name.startswith("racer") and name.endswith("racer"):
            ref, what = results[name[: -len("racer")] + "off"], "off"
        else:
            ref, what = (ref_gguf, "gguf off") if name != "racer gguf off" else (None, "")
        equal = "-" if ref is None else f"{sum(a[0] == b[0] for a, b in zip(runs, ref))}/{len(runs)} {what}"
        med = statistics.median(n / s for _, n, s in runs)
        x = f"{rate[name] / rate['llama.cpp plain']:.2f}" if base else "-"
        rows.append((name, f"{rate[name]:.1f}", f"{med:.1f}", x, equal))
    print(
        f"\n{len(prompts)} Spec-Bench prompts, {args.max_new_tokens} tokens, greedy, one at a time, prefill "
        f"included; llama.cpp {args.threads} threads"
    )
    print(table(["server", "tok/s", "median tok/s", "x llama.cpp plain", "equal"], rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            recs = [
                {"server": name, "question_id": p.question_id, "text": t, "tokens": n, "seconds": sec}
                for name, runs in results.items()
                for p, (t, n, sec) in zip(prompts, runs)
            ]
            json.dump(recs, f, indent=1)
    return 0
