"""Grammar libraries on this CPU, for the choice in ``gateway/grammar.py``: schema compile time, the
cost of one token's mask, and of a rollback, over the BFCL function schemas (tool-call objects) and
the default model's vocabulary.

    PYTHONPATH=$PWD .venv/bin/python -m racer.bench.grammar --schemas 60

Prints one table: per library, medians (and the 90th percentile) over the schemas; per-token
figures walk a valid call for each schema, token by token, as a decode would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from common import settings

from ..prompts import BFCL

_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def json_schema(params: dict) -> dict:
    """BFCL's parameter documentation (Python type names) as JSON Schema."""
    out = {}
    for k, v in params.items():
        if k == "type":
            t = _TYPES.get(v, v)
            if t is not None:
                out[k] = t
        elif k == "properties":
            out[k] = {name: json_schema(p) for name, p in v.items()}
        elif k in ("items", "additionalProperties") and isinstance(v, dict):
            out[k] = json_schema(v)
        elif k in ("required", "enum", "description", "default"):
            out[k] = v
    if out.get("type") == "object":
        out.setdefault("properties", {})
    return out


def bfcl_tools(path: Path, limit: int) -> list[dict]:
    """Distinct function schemas of a BFCL file, as OpenAI tools."""
    seen, out = set(), []
    for line in path.read_text().splitlines():
        for f in json.loads(line)["function"]:
            if f["name"] in seen:
                continue
            seen.add(f["name"])
            params = json_schema(f.get("parameters") or {"type": "object"})
            out.append({"type": "function", "function": {"name": f["name"], "parameters": params}})
            if len(out) == limit:
                return out
    return out


def sample(schema: dict):
    """A small value the schema accepts."""
    t = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if t == "object":
        req = schema.get("required", list(schema.get("properties", {})))
        return {k: sample(schema["properties"].get(k, {"type": "string"})) for k in req if k in schema["properties"]}
    return {"integer": 7, "number": 1.5, "boolean": True, "array": [], "string": 'Paris, "FR"'}.get(t, "x")


def call_text(tool: dict) -> str:
    f = tool["function"]
    return json.dumps({"name": f["name"], "arguments": sample(f["parameters"])})


def call_schema(tool: dict) -> dict:
    f = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def bench_xgrammar(tok, vocab: int, tools: list[dict]) -> dict:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t
    out = {"setup_s": setup, "compile": [], "mask": [], "rollback": [], "valid": 0}
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for tool in tools:
        schema = json.dumps(call_schema(tool))
        t = time.perf_counter()
        try:
            g = compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        except Exception:  # noqa: BLE001 - a schema this library refuses: counted out
            continue
        out["compile"].append(time.perf_counter() - t)
        m = xgr.GrammarMatcher(g, max_rollback_tokens=-1)
        ids = tok(call_text(tool), add_special_tokens=False)["input_ids"]
        ok = True
        for i in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            out["mask"].append(time.perf_counter() - t)
            ok = ok and m.accept_token(i)
        out["valid"] += ok
        t = time.perf_counter()
        m.rollback(min(8, len(ids)))
        out["rollback"].append(time.perf_counter() - t)
    return out


def bench_llguidance(tok, vocab: int, tools: list[dict]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    t = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t
    out = {"setup_s": setup, "compile": [], "mask": [], "rollback": [], "valid": 0}
    bitmask = lln.allocate_token_bitmask(1, vocab)
    for tool in tools:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(call_schema(tool)),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        t = time.perf_counter()
        m = llguidance.LLMatcher(lt, grammar)
        if m.is_error():
            continue
        lln.fill_next_token_bitmask(m, bitmask, 0)  # the lexer is built lazily: count its first mask as compile
        out["compile"].append(time.perf_counter() - t)
        ids = tok(call_text(tool), add_special_tokens=False)["input_ids"]
        ok = True
        for i in ids:
            t = time.perf_counter()
            lln.fill_next_token_bitmask(m, bitmask, 0)
            out["mask"].append(time.perf_counter() - t)
            ok = ok and m.consume_token(i)
        out["valid"] += ok
        t = time.perf_counter()
        m.rollback(min(8, len(ids)))
        out["rollback"].append(time.perf_counter() - t)
    return out


def _ms(xs: list[float], q: float = 0.5) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3:.3f}"


def main(argv=None) -> None:
    ap = settings.CommandParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=int, default=60)
    settings.add_flag(ap, "verifier", "--model")
    args = ap.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from verifier.model import resolve_model_dir

    path = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    tools = bfcl_tools(BFCL / "BFCL_v4_live_multiple.json", args.schemas)
    print(f"{len(tools)} BFCL call schemas, vocabulary {vocab}; ms, median (p90); one thread")
    print(f"{'library':<12}{'setup':>9}{'compile':>16}{'mask/token':>18}{'rollback 8':>16}{'valid':>8}")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            r = fn(tok, vocab, tools)
        except ImportError as e:
            print(f"{name:<12} not installed ({e})")
            continue
        print(
            f"{name:<12}{r['setup_s'] * 1e3:>9.0f}"
            f"{_ms(r['compile']) + ' (' + _ms(r['compile'], 0.9) + ')':>16}"
            f"{_ms(r['mask']) + ' (' + _ms(r['mask'], 0.9) + ')':>18}"
            f"{_ms(r['rollback']) + ' (' + _ms(r['rollback'], 0.9) + ')':>16}"
            f"{r['valid']:>5}/{len(r['compile'])}"
        )


if __name__ == "__main__":
    main()
