"""Schema-constrained tool calls through a local stack: MAT and tokens/s without drafts, with the
usual drafting, and with the grammar's forced tokens drafted as a path of their own, on BFCL
function-calling prompts (one named function per prompt, greedy).

    PYTHONPATH=$PWD .venv/bin/python -m racer.bench.forced --prompts 20

Prints one row per configuration (medians over the prompts) and whether every output equals the
output without drafts token for token.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from common import settings

from ..prompts import BFCL
from .grammar import json_schema

CONFIGS = (
    ("no drafts", {"mode": "off"}),
    ("drafts", {"mode": "racer", "forced": False}),
    ("drafts + forced", {"mode": "racer", "forced": True}),
)


def prompts(path: Path, n: int) -> list[tuple[list[dict], dict]]:
    """(messages, tool) of the first ``n`` one-function BFCL queries."""
    out = []
    for line in path.read_text().splitlines()[:n]:
        q = json.loads(line)
        f = q["function"][0]
        tool = {
            "type": "function",
            "function": {
                "name": f["name"],
                "description": f.get("description", "")[:300],
                "parameters": json_schema(f.get("parameters") or {"type": "object"}),
            },
        }
        out.append((q["question"][0], tool))
    return out


def main(argv=None) -> None:
    ap = settings.CommandParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=96)
    settings.add_flag(ap, "verifier", "--model")
    args = ap.parse_args(argv)
    import openai

    from ..stack import client_key, running

    work = prompts(BFCL / "BFCL_v4_live_simple.json", args.prompts)
    rows: dict[str, dict[str, list[float]]] = {
        name: {"mat": [], "tps": [], "decode": [], "tokens": []} for name, _ in CONFIGS
    }
    same = {name: 0 for name, _ in CONFIGS}
    with running(args.model, http_port=8000, any_ports=True) as gateway:
        url = f"http://127.0.0.1:{gateway.http_port}/v1"
        client = openai.OpenAI(base_url=url, api_key=client_key() or "none", max_retries=0)
        model = client.models.list().data[0].id
        for messages, tool in work:
            choice = {"type": "function", "function": {"name": tool["function"]["name"]}}
            ref = None
            for name, spec in CONFIGS:  # interleaved prompt by prompt: load drifts hit every config alike
                t0 = time.perf_counter()
                r = client.chat.completions.create(
                    model=model,
                    messages=messages,
                    tools=[tool],
                    tool_choice=choice,
                    max_tokens=args.max_tokens,
                    extra_body={"speculation": spec, "return_token_ids": True, "share": False},
                )
                secs = time.perf_counter() - t0
                ids = r.choices[0].model_extra["token_ids"]
                ref = ids if ref is None else ref
                same[name] += ids == ref
                s = r.model_extra["speculation"]
                rows[name]["mat"].append(s["mat"])
                rows[name]["tps"].append(len(ids) / secs)
                rows[name]["decode"].append(len(ids) / max(1e-9, (s["total_ms"] - s["prefill_ms"]) / 1e3))
                rows[name]["tokens"].append(len(ids))
    print(f"{len(work)} BFCL live_simple prompts, named tool call, greedy, max_tokens {args.max_tokens}; medians")
    print("tok/s: over the whole call; decode: after the prefill (the gateway's own timing)")
    print(f"{'config':<18}{'MAT':>7}{'tok/s':>9}{'decode':>9}{'tokens':>8}{'same as no drafts':>20}")
    for name, _ in CONFIGS:
        r = rows[name]
        print(
            f"{name:<18}{statistics.median(r['mat']):>7.2f}{statistics.median(r['tps']):>9.1f}"
            f"{statistics.median(r['decode']):>9.1f}"
            f"{statistics.median(r['tokens']):>8.0f}{same[name]:>14}/{len(work)}"
        )


if __name__ == "__main__":
    main()
