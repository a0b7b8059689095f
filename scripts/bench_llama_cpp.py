"""llama.cpp's ``llama-server`` on the bundled GGUF file, on the prompts ``racer bench`` runs.

Each prompt is rendered by the model's chat template into token ids (as ``racer bench`` does), sent
to ``/completion`` greedy (top-k 1), ``n_predict`` tokens, no prompt cache, one request at a time;
tok/s is new tokens over the request's wall time, prefill included. Modes: ``plain`` and each
``--spec-type`` given (llama.cpp's n-gram speculation). With ``--racer-json`` (``racer bench
--json``'s records), it counts the prompts whose greedy text equals racer's ``off`` output (a sanity
check that both compute the same model; not the exactness contract).

    scripts/build_llama_cpp.sh      # prints the server's path
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_llama_cpp.py --server PATH --per-category 1 --threads 2
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import time
import urllib.request

from common.text import DEFAULT_SYSTEM, chat_ids
from racer.prompts import load_spec_bench
from verifier.model import default_gguf_path, resolve_model_dir


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _serve(server: str, threads: int, extra: list[str]):
    port = _port()
    cmd = [server, "-m", str(default_gguf_path()), "--port", str(port), "-t", str(threads), "-tb", str(threads)]
    cmd += ["-c", "4096", "-np", "1", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="llama-server binary (scripts/build_llama_cpp.sh)")
    ap.add_argument("--prompts", default="/work/shared/data/spec_bench/question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec-types", default="ngram-simple,ngram-mod", help="comma-separated; '' for plain only")
    ap.add_argument("--racer-json", default="", help="racer bench --json records: count equal greedy outputs")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_dir())
    prompts = load_spec_bench(args.prompts, args.per_category)
    ids = [chat_ids(tok, p.text, DEFAULT_SYSTEM) for p in prompts]
    racer_off = {}
    if args.racer_json:
        with open(args.racer_json, encoding="utf-8") as f:
            recs = json.load(f)
        racer_off = {r["question_id"]: r["output_ids"] for r in recs if r.get("mode") == "off"}
    modes = [("plain", [])] + [(s, ["--spec-type", s]) for s in args.spec_types.split(",") if s]
    print(f"llama-server {args.server}; {len(prompts)} prompts, {args.max_new_tokens} tokens, {args.threads} threads")
    print("| mode | tok/s (total) | median tok/s | equal to racer off |")
    print("|---|---|---|---|")
    for name, extra in modes:
        proc, url = _serve(args.server, args.threads, extra)
        try:
            _post(url + "/completion", {"prompt": ids[0], "n_predict": 4, "top_k": 1, "cache_prompt": False})
            tokens, secs, rates, equal = 0, 0.0, [], 0
            for p, prompt in zip(prompts, ids):
                body = {"prompt": prompt, "n_predict": args.max_new_tokens, "top_k": 1, "temperature": 0.0}
                body |= {"cache_prompt": False, "return_tokens": True, "samplers": ["top_k"]}
                t0 = time.perf_counter()
                out = _post(url + "/completion", body)
                dt = time.perf_counter() - t0
                n = out.get("tokens_predicted", len(out.get("tokens", [])))
                tokens, secs = tokens + n, secs + dt
                rates.append(n / dt)
                if racer_off.get(p.question_id) is not None:
                    equal += out.get("tokens", [])[: len(racer_off[p.question_id])] == racer_off[p.question_id]
        finally:
            proc.terminate()
            proc.wait(30)
        eq = f"{equal}/{len(racer_off)}" if racer_off else "-"
        print(f"| llama.cpp {name} | {tokens / secs:.1f} | {statistics.median(rates):.1f} | {eq} |", flush=True)


if __name__ == "__main__":
    main()
