"""Time to first token of a continued response (``previous_response_id``: the session holds the
history) against a stateless one (``store: false``, the whole history as input items), through a
running stack's OpenAI API. Prints a table of medians, each pair of requests asked back to back.

    racer stack --keep --any-ports          # prints the OpenAI API's base URL
    python scripts/bench_responses_ttft.py http://127.0.0.1:PORT/v1 [--history 2000] [--runs 7]

A conversation is grown by continued responses to ``--history`` tokens; then each run asks one new
question twice, statelessly and continued (the first run warms up and is left out). Both must
answer the same text (counted). ``prefill ms`` is the gateway's (the verifier's open and the
drafter's), ``cached`` the history tokens the verifier did not prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai

TOPICS = (
    "the history of the bicycle",
    "how bread is made",
    "why the sky is blue",
    "how a compass works",
    "the rules of chess",
    "how rain forms",
    "the life of bees",
    "how a piano makes sound",
    "what a volcano is",
    "how ships float",
    "the phases of the moon",
    "how paper is made",
)


def _stream(client, kw: dict, **args):
    """(seconds to the first text delta, the final response)."""
    t0, first, final = time.perf_counter(), None, None
    with client.responses.stream(**kw, **args) as s:
        for e in s:
            if e.type == "response.output_text.delta" and first is None:
                first = time.perf_counter() - t0
            if e.type in ("response.completed", "response.incomplete"):
                final = e.response
    return first if first is not None else time.perf_counter() - t0, final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--history", type=int, default=2000, help="tokens the conversation reaches first")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--api-key", default="none")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, timeout=600)
    kw = dict(model=client.models.list().data[0].id, instructions="You are a helpful assistant.")
    prev, items = None, []
    while prev is None or prev.usage.total_tokens < args.history:
        q = f"Tell me about {TOPICS[(len(items) // 2) % len(TOPICS)]}, in detail."
        prev = client.responses.create(**kw, input=q, previous_response_id=prev and prev.id, max_output_tokens=200)
        items += [{"role": "user", "content": q}, {"role": "assistant", "content": prev.output_text}]
    rows: dict[str, list] = {"stateless (store: false)": [], "continued (previous_response_id)": []}
    same = 0
    for i in range(args.runs):
        q = {"role": "user", "content": f"Now summarize point {i + 1} in one sentence."}
        n = args.max_output_tokens
        t_s, r_s = _stream(client, kw, input=[*items, q], store=False, max_output_tokens=n)
        t_c, r_c = _stream(client, kw, input=[q], previous_response_id=prev.id, max_output_tokens=n)
        if i:  # the first pair warms up
            rows["stateless (store: false)"].append((t_s, r_s))
            rows["continued (previous_response_id)"].append((t_c, r_c))
            same += r_s.output_text == r_c.output_text
        items += [q, {"role": "assistant", "content": r_c.output_text}]
        prev = r_c
    print(f"| request | input tokens | cached | TTFT ms | prefill ms | MAT |  ({same}/{args.runs - 1} the same text)")
    print("|---|---|---|---|---|---|")
    for name, rs in rows.items():

        def med(f, rs=rs):
            return statistics.median(f(t, r) for t, r in rs)

        spec = lambda r: r.model_extra["speculation"]  # noqa: E731
        print(
            f"| {name} | {med(lambda t, r: r.usage.input_tokens):.0f} "
            f"| {med(lambda t, r: r.usage.input_tokens_details.cached_tokens):.0f} | {med(lambda t, r: t * 1e3):.0f} "
            f"| {med(lambda t, r: spec(r)['prefill_ms']):.0f} | {med(lambda t, r: spec(r)['mat']):.2f} |"
        )


if __name__ == "__main__":
    main()
