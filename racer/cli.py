"""The ``racer`` command: one subcommand per job, each a row of ``COMMANDS``.

- Serving: ``serve drafter|verifier|gateway`` (one service, settings from flags or ``RACER_*``
  variables, common/settings.py; racer/launch.py), ``stack`` (the three on localhost, an answer streamed through
  them), ``health`` (a service's grpc.health.v1), ``erase-corpus`` (a tenant's corpus, everywhere).
- Clients: ``client generate|chat|sessions|close`` and ``load`` (concurrent sessions, bounded),
  against a running gateway.
- In this process, no services: ``generate`` (stream an answer), ``prior`` (a model's copy-logit
  prior).
- Benchmarks that print tables: ``bench`` (against HF greedy and prompt lookup), ``bench-stack``,
  ``bench-batch``, ``bench-burst``, ``bench-corpus``, ``bench-snapshot``, ``bench-tools``.

A command runs as ``module:function`` (or a function of this module), imported when it runs: a
container's ``racer health`` probe, run every few seconds, never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

# gRPC's legacy I/O manager instead of its EventEngine for channels and listeners: one message
# crosses fewer threads. Measured here (loopback bidi round trip, p50): 0.16-0.20 ms against
# 0.26-0.37 ms, and ~0.1 ms less per hop in a draft-verify round. Read once, when gRPC starts, so it
# is set before anything imports it; an explicit GRPC_EXPERIMENTS wins.
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")

from common import settings  # noqa: E402
from common.params import MODES  # noqa: E402
from common.settings import PORTS, SettingError  # noqa: E402

from .exits import ServiceFailed  # noqa: E402  (stdlib only, as the next)
from .prompts import BFCL  # noqa: E402  (stdlib only: a health probe still imports no torch)

DEFAULT_SYSTEM = "You are a helpful assistant."  # the system prompt of every command that chats
DEFAULT_PROMPT = "Explain speculative decoding in three sentences."
_DEFAULT_BFCL = str(BFCL / "BFCL_v4_live_multiple.json")


def _csv(kind):
    def parse(s: str):
        try:
            return [kind(x) for x in s.split(",") if x]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _budget(s: str) -> int:
    return 0 if s == "auto" else int(s)


# -- flags several commands share ------------------------------------------------------------------


def system_flag(parser) -> None:
    parser.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt ('' for none)")


def pin_flag(parser) -> None:
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let the verifier share CPUs with the other services (default: CPUs of its own)",
    )


def model_flag(parser) -> None:
    help = (
        "'default' (the bundled SmolLM2-135M-Instruct), a Hugging Face model directory, or a GGUF file "
        "(or a directory holding one)"
    )
    settings.add_flag(parser, "verifier", "--model", help=help)


def dtype_flag(parser) -> None:
    settings.add_flag(parser, "verifier", "--dtype")


def threads_flag(parser) -> None:
    """Torch's threads in this process, as the verifier's ``--threads`` (0: torch's, one per core)."""
    settings.add_flag(parser, "verifier", "--threads")


def tls_flags(parser) -> None:
    parser.add_argument("--tls-ca", default="", help="TLS to the gateway: PEM CA that signed its certificate")
    parser.add_argument("--tls-cert", default="", help="this client's PEM certificate, when the gateway requires one")
    parser.add_argument("--tls-key", default="", help="the PEM private key of --tls-cert")


def engine_flags(parser) -> None:
    """The in-process commands' model, backend and drafting flags."""
    model_flag(parser)
    settings.add_flag(parser, "verifier", "--backend")
    dtype_flag(parser)
    system_flag(parser)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--no-prior",
        dest="prior",
        action="store_false",
        help="no model-derived copy-logit prior for tokens a session has not seen yet",
    )
    settings.add_flag(parser, "drafter", "--logits-tree")  # the served drafter's setting, the same default


def answer_flags(parser, budget_default: int = 0) -> None:
    """The prompt-through-a-stack commands' flags: a model, a system prompt, a mode and a budget."""
    model_flag(parser)
    system_flag(parser)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--mode", default="racer", choices=MODES)
    parser.add_argument(
        "--budget",
        type=_budget,
        default=budget_default,
        help="draft tree nodes per round (C); auto (0): cost-aware adaptive (default %(default)s)",
    )


def stack_flags(parser, port_base: int = 0, metrics_base: int = PORTS["gateway"][1]) -> None:
    """Where a local stack serves: its ports, and whether the verifier gets CPUs of its own."""
    dtype_flag(parser)
    parser.add_argument(
        "--port-base", type=int, default=port_base, help="gateway, drafter, verifier on this port and the next two"
    )
    parser.add_argument("--metrics-base", type=int, default=metrics_base)
    pin_flag(parser)


def cmd_generate(args) -> int:
    from common.loop import Stats
    from common.params import SamplingParams
    from common.text import Detokenizer, has_chat_template, prompt_ids

    from .inprocess import InProcessStack

    engine = InProcessStack.load(
        args.model, backend=args.backend, prior=args.prior, dtype=args.dtype, logits_tree=args.logits_tree
    )
    if args.budget == 0:
        engine.measure_costs()
    if not has_chat_template(engine.tokenizer):
        print(f"racer: {args.model} has no chat template, so the prompt is continued as text", file=sys.stderr)
    ids = prompt_ids(engine.tokenizer, args.prompt, args.system or None)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    params = engine.default_params(max_new_tokens=args.max_new_tokens, mode=args.mode, budget=args.budget)
    stats = Stats()
    detok = Detokenizer(engine.tokenizer)
    for chunk in engine.stream(ids, params, sampling, stats):
        sys.stdout.write(detok.push(chunk))
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(
        f"[{args.mode} C={args.budget}] tokens={stats.new_tokens} rounds={stats.rounds} MAT={stats.mat:.2f} "
        f"tok/s={stats.tokens_per_s:.1f} prefill={stats.prefill_s * 1e3:.0f}ms "
        f"verify={stats.verify_s:.2f}s draft={stats.draft_s * 1e3:.0f}ms",
        file=sys.stderr,
    )
    return 0


def cmd_prior(args) -> int:
    """Computes (or finds) the copy-logit prior of a model and writes it where ``find_or_compute`` looks."""
    from pathlib import Path

    from verifier.model import load
    from verifier.prior import find_or_compute

    loaded = load(args.model)
    table = find_or_compute(loaded.model, loaded.tokenizer, args.topk, cache_dir=Path(args.out) if args.out else None)
    if table is None:
        print("racer: no prior for this model type", file=sys.stderr)
        return 1
    print(f"prior: {table.shape[0]} tokens x top-{table.shape[1]}")
    return 0


def cmd_health(args) -> int:
    from common.health import main
    from common.tls import channel_credentials

    return main(args.target, args.service, channel_credentials(args.tls_ca, args.tls_cert, args.tls_key))


def cmd_erase_corpus(args) -> int:
    """Erases a tenant's corpus through one drafter: in Redis, and on every replica at its next sync."""
    import grpc

    from common import identity
    from common.tls import channel_credentials
    from common.v1 import drafter_pb2, drafter_pb2_grpc

    tokens = identity.load_tokens(os.environ.get("RACER_INTERNAL_TOKEN", ""), args.token_file)
    creds = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    with grpc.secure_channel(args.target, creds) if creds else grpc.insecure_channel(args.target) as ch:
        resp = drafter_pb2_grpc.DrafterStub(ch).EraseCorpus(
            drafter_pb2.EraseCorpusRequest(tenant=args.tenant), timeout=30, metadata=identity.metadata(tokens)
        )
    print(f"tenant {args.tenant}: corpus {'erased' if resp.existed else 'was empty (erased anyway)'}")
    return 0


# ``racer bench-corpus --through``: the module that runs it
BENCH_CORPUS = {"process": "racer.bench.corpus", "stack": "racer.bench.corpus_stack"}


def cmd_bench_corpus(args) -> int:
    return _import(BENCH_CORPUS[args.through], "bench-corpus").main(args)


# -- each command's arguments ------------------------------------------------------------------------


def generate_arguments(g) -> None:
    engine_flags(g)
    g.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    g.add_argument("--mode", default="racer", choices=MODES)
    g.add_argument(
        "--budget", type=_budget, default=16, help="draft tree nodes per round (C); 'auto': cost-aware adaptive"
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)


def bench_arguments(b) -> None:
    engine_flags(b)
    b.add_argument(
        "--prompts", default=None, help="Spec-Bench-format JSONL (default: ../shared/data/spec_bench/question.jsonl)"
    )
    b.add_argument("--per-category", type=int, default=0, help="first N prompts of each category")
    b.add_argument("--humaneval", type=int, default=0, help="first N HumanEval prompts")
    b.add_argument(
        "--modes",
        type=_csv(str),
        default=["greedy", "hf-pld", "off", "racer", "retrieval", "logits", "last-logit", "pld"],
    )
    b.add_argument(
        "--budget", type=_csv(_budget), default=[16], help="comma-separated tree sizes; 'auto': cost-aware adaptive"
    )
    threads_flag(b)  # every mode's, HF's included
    b.add_argument("--json", default=None, help="write one record per prompt x mode x budget")
    b.add_argument("--plot", default=None, help="write a PNG chart")


def serve_arguments(sv) -> None:
    services = sv.add_subparsers(dest="service", required=True)
    for name in PORTS:
        settings.add_arguments(services.add_parser(name, help=f"the {name} service"), name)


def stack_arguments(st) -> None:
    st.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    answer_flags(st)
    stack_flags(st)
    st.add_argument("--keep", action="store_true", help="keep the stack up for other clients until Ctrl-C")
    settings.add_flag(st, "gateway", "--http-port", default=8000)  # the stack's HTTP API is on unless told
    settings.add_flag(st, "gateway", "--chat-template")  # for a model without one of its own
    st.add_argument(
        "--any-ports",
        action="store_true",
        help="every listener (gRPC, metrics, HTTP) on a port the OS picks, read back and printed; "
        "--port-base and --metrics-base are then unused (a stack beside other programs)",
    )
    settings.add_flag(st, "verifier", "--log-level", default="WARNING")  # every service's; quiet unless told


def soak_arguments(sk) -> None:
    sk.add_argument("--minutes", type=float, default=5.0, help="how long the load runs (default %(default)s)")
    sk.add_argument("--clients", type=int, default=3, help="client threads, each one request at a time")
    sk.add_argument("--burst", type=int, default=8, help="one-call OpenAI requests sent at once in a burst")
    sk.add_argument("--max-new-tokens", type=int, default=32)
    sk.add_argument("--sample-seconds", type=float, default=5.0, help="how often memory is sampled")
    sk.add_argument("--seed", type=int, default=0)
    sk.add_argument(
        "--waves",
        type=int,
        default=0,
        help="instead: this many identical waves of --burst requests, no faults; "
        "the verifiers' memory once idle after each",
    )
    model_flag(sk)
    dtype_flag(sk)


def client_arguments(cl) -> None:
    cl.add_argument("action", choices=("generate", "chat", "sessions", "close"))
    cl.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    cl.add_argument("--target", default=f"localhost:{PORTS['gateway'][0]}")
    cl.add_argument("--api-key", default=None, help="tenant API key (or env RACER_API_KEY)")
    cl.add_argument("--session", default=None, help="continue (or, with close, close) this session")
    system_flag(cl)
    cl.add_argument("--max-new-tokens", type=int, default=256)
    cl.add_argument("--mode", default="racer", choices=MODES)
    cl.add_argument("--budget", type=_budget, default=0, help="tree nodes per round; auto (0, default): adaptive")
    cl.add_argument("--temperature", type=float, default=0.0)
    cl.add_argument("--seed", type=int, default=None)
    tls_flags(cl)


def bench_stack_arguments(bs) -> None:
    answer_flags(bs)
    bs.set_defaults(max_new_tokens=128)
    stack_flags(bs)
    bs.add_argument("--prompts", default=None)
    bs.add_argument("--per-category", type=int, default=1)


def bench_batch_arguments(bb) -> None:
    answer_flags(bb, budget_default=4)
    bb.set_defaults(max_new_tokens=64)
    stack_flags(bb, port_base=50151, metrics_base=9200)
    bb.add_argument("--prompts", default=None)
    bb.add_argument("--sessions", type=_csv(int), default=[1, 2, 4, 8, 16])


def bench_burst_arguments(bu) -> None:
    model_flag(bu)
    bu.add_argument("--requests", type=int, default=64)
    bu.add_argument("--max-new-tokens", type=int, default=48)
    bu.add_argument("--reps", type=int, default=1, help="bursts per configuration (interleaved)")
    bu.add_argument("--seed", type=int, default=0)
    bu.add_argument("--port-base", type=int, default=50251)
    bu.add_argument("--metrics-base", type=int, default=9300)
    bu.add_argument("--http-port", type=int, default=8250, help="the first stack's; the second uses the next")
    pin_flag(bu)


def load_arguments(ld) -> None:
    ld.add_argument(
        "--target",
        default=f"localhost:{PORTS['gateway'][0]}",
        help="gateway address (loopback only); several, comma-separated: each session's turns rotate over them",
    )
    ld.add_argument("--sessions", type=int, default=16, help="concurrent sessions (at most 256)")
    ld.add_argument("--turns", type=int, default=3, help="turns per session (at most 32)")
    ld.add_argument("--max-new-tokens", type=int, default=64, help="per turn (at most 1024)")
    ld.add_argument("--seed", type=int, default=0, help="prompt seed: the same seed sends the same requests")
    ld.add_argument(
        "--ids",
        type=int,
        default=0,
        metavar="VOCAB",
        help="send random token ids below VOCAB instead of text prompts (a gateway with --model none)",
    )
    ld.add_argument("--prompt-tokens", type=int, default=16, help="with --ids: tokens per turn")
    ld.add_argument("--time-limit", type=float, default=120.0, help="seconds for the whole run (at most 600)")
    ld.add_argument(
        "--api-key",
        default=None,
        help="tenant API key (or env RACER_API_KEY); several, comma-separated: sessions alternate over the tenants",
    )
    ld.add_argument("--mode", default="", help="speculation mode (default: the server's)")
    ld.add_argument("--budget", type=int, default=0, help="draft budget (0: the server's)")
    ld.add_argument("--keep-sessions", action="store_true", help="do not close the sessions at the end")
    ld.add_argument("--json", default=None, help="also write the report as JSON")
    tls_flags(ld)


def bench_corpus_arguments(bc) -> None:
    engine_flags(bc)
    bc.add_argument("--prompts", default=None, help="Spec-Bench JSONL (default: the shared copy)")
    bc.add_argument(
        "--runs", type=_csv(str), default=["category", "repeat"], help="category and/or repeat (comma-separated)"
    )
    bc.add_argument("--sessions", type=int, default=16, help="sessions per category; prompts of the repeat run")
    bc.add_argument("--categories", type=_csv(str), default=None, help="only these Spec-Bench categories")
    bc.add_argument("--budget", type=_csv(int), default=[16, 64], help="tree sizes C (comma-separated)")
    settings.add_flag(bc, "drafter", "--corpus-tokens")
    threads_flag(bc)
    bc.add_argument("--hf", action="store_true", help="also compare every output with Hugging Face greedy decoding")
    bc.add_argument("--json", default=None, help="also write one record per session to JSON.RUN.jsonl")
    bc.add_argument(
        "--through",
        default="process",
        choices=tuple(BENCH_CORPUS),
        help="stack: the repeat run also through real services (Redis, a verifier, drafter replicas), "
        "sessions alternating between the replicas",
    )
    bc.add_argument("--drafters", type=int, default=2, help="drafter replicas with --through stack (2 or more)")


def bench_llama_cpp_arguments(bl) -> None:
    bl.add_argument("--server", default="", help="llama-server binary (scripts/build_llama_cpp.sh); '' for racer only")
    help = "the GGUF file both sides serve: 'default' (the bundled file), a .gguf file or a directory holding one"
    settings.add_flag(bl, "verifier", "--model", help=help)
    bl.add_argument(
        "--api",
        default="auto",
        choices=("auto", "chat", "completions"),
        help="the endpoint both sides get: /v1/chat/completions or /v1/completions (auto: chat where the file "
        "has a chat template)",
    )
    bl.add_argument(
        "--schedule",
        default="interleaved",
        choices=("interleaved", "alone", "both"),
        help="interleaved: every server up, each prompt to each in turn; alone: one server up at a time; both",
    )
    bl.add_argument(
        "--prompts", default=None, help="Spec-Bench-format JSONL (default: ../shared/data/spec_bench/question.jsonl)"
    )
    bl.add_argument("--per-category", type=int, default=2, help="first N prompts of each category")
    bl.add_argument("--max-new-tokens", type=int, default=128)
    bl.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    bl.add_argument("--spec-types", default="ngram-simple,ngram-mod", help="llama.cpp's n-gram modes ('' for none)")
    bl.add_argument(
        "--dtypes",
        default="gguf,bfloat16,float32",
        help="racer stacks to run, one per dtype (auto: what racer stack serves the file in by default)",
    )
    bl.add_argument("--budget", type=int, default=0, help="racer's draft tree nodes per round (0: adaptive)")
    bl.add_argument("--no-pin", action="store_true", help="the stack's services share every CPU")
    bl.add_argument("--json", default="", help="write every answer (text, tokens, seconds) here")


def bench_tools_arguments(bt) -> None:
    model_flag(bt)
    dtype_flag(bt)
    bt.add_argument(
        "input",
        nargs="?",
        default=_DEFAULT_BFCL,
        help="sessions as JSONL (racer/tool_sessions.py: tenant, tools or system, turns) or a BFCL file "
        "(converted on the fly; default: the shared BFCL v4 live_multiple)",
    )
    bt.add_argument("--convert", default="", metavar="OUT", help="only write the BFCL input to OUT as JSONL")
    bt.add_argument("--through", default="stack", choices=("stack", "process"), help="real services or this process")
    bt.add_argument("--tenants", type=int, default=2, help="tenants (tool sets) to run")
    bt.add_argument("--sessions", type=int, default=4, help="sessions per tenant, one after another")
    bt.add_argument("--turns", type=int, default=4, help="turns per session at most")
    bt.add_argument(
        "--min-system-chars",
        type=int,
        default=0,
        help="only tenants whose system prompt has at least this many characters",
    )
    bt.add_argument("--max-new-tokens", type=int, default=64)
    bt.add_argument("--budget", type=int, default=16, help="draft tree nodes per round (C)")
    settings.add_flag(bt, "drafter", "--corpus-tokens")
    threads_flag(bt)  # --through process
    bt.add_argument(
        "--no-prior", dest="prior", action="store_false", help="no model-derived copy-logit prior in the drafter"
    )
    bt.add_argument(
        "--env", action="append", default=[], metavar="RACER_X=V", help="a setting for every service of the stack"
    )
    pin_flag(bt)


def bench_snapshot_arguments(bn) -> None:
    bn.add_argument("--store", default="memory://", help="memory:// or redis://host:port/db")
    bn.add_argument("--tokens", type=int, default=4000, help="context tokens at least")
    bn.add_argument("--repeat", type=int, default=20)


def erase_corpus_arguments(ec) -> None:
    ec.add_argument("tenant")
    ec.add_argument("--target", default=f"localhost:{PORTS['drafter'][0]}", help="any drafter of the deployment")
    ec.add_argument(
        "--token-file",
        default=os.environ.get("RACER_INTERNAL_TOKEN_FILE", ""),
        help="file holding the internal token (or env RACER_INTERNAL_TOKEN)",
    )
    tls_flags(ec)


def prior_arguments(pr) -> None:
    model_flag(pr)
    settings.add_flag(pr, "drafter", "--topk")
    pr.add_argument("--out", default=None, help="directory (default: ~/.cache/racer/priors)")


def health_arguments(hc) -> None:
    hc.add_argument("target", help="[HOST:]PORT")
    hc.add_argument("service", nargs="?", default="", help="e.g. racer.v1.Drafter ('': the server as a whole)")
    hc.add_argument("--tls-ca", default=os.environ.get("RACER_TLS_CA", ""), help="CA of the service's certificate")
    hc.add_argument(
        "--tls-cert",
        default=os.environ.get("RACER_TLS_CLIENT_CERT", ""),
        help="client certificate, when the service requires one",
    )
    hc.add_argument("--tls-key", default=os.environ.get("RACER_TLS_CLIENT_KEY", ""))


# -- the table -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int] | str  # a function, or "module:function" imported when it runs


COMMANDS = (
    Command(
        "generate",
        "stream an answer to a prompt (the engine in this process, no services)",
        generate_arguments,
        cmd_generate,
    ),
    Command("bench", "benchmark against HF greedy and prompt lookup", bench_arguments, "racer.bench.modes:main"),
    Command(
        "serve",
        "run one service (settings from flags or RACER_* environment variables)",
        serve_arguments,
        "racer.launch:serve",
    ),
    Command(
        "stack",
        "drafter, verifier and gateway on localhost; stream an answer through them",
        stack_arguments,
        "racer.stack:run",
    ),
    Command("client", "talk to a running gateway", client_arguments, "racer.client:main"),
    Command(
        "soak",
        "mixed load for N minutes while a drafter, a verifier and Redis are restarted; lost, changed, memory",
        soak_arguments,
        "racer.soak:main",
    ),
    Command(
        "bench-stack",
        "tokens/s through the gateway vs in process, side by side",
        bench_stack_arguments,
        "racer.bench.services:bench_stack",
    ),
    Command(
        "bench-batch",
        "aggregate tok/s of N concurrent sessions, batching on vs off",
        bench_batch_arguments,
        "racer.bench.services:bench_batch",
    ),
    Command(
        "bench-burst",
        "a burst of streaming chat requests through the OpenAI API, prefills batched vs one at a time",
        bench_burst_arguments,
        "racer.bench.burst:bench_burst",
    ),
    Command(
        "load",
        "N concurrent sessions x T turns through a gateway on this machine (bounded)",
        load_arguments,
        "racer.bench.loadgen:main",
    ),
    Command(
        "bench-corpus",
        "fresh sessions one after another: MAT and tok/s with the tenant corpus on and off",
        bench_corpus_arguments,
        cmd_bench_corpus,
    ),
    Command(
        "bench-snapshot",
        "size and save/restore time of a full drafter session snapshot",
        bench_snapshot_arguments,
        "racer.bench.services:bench_snapshot",
    ),
    Command(
        "bench-tools",
        "function-calling sessions per tenant (tool set): TTFT, MAT and tok/s with everything on and off",
        bench_tools_arguments,
        "racer.bench.tools:main",
    ),
    Command(
        "bench-llama-cpp",
        "llama.cpp's llama-server and the stack on one GGUF file, side by side",
        bench_llama_cpp_arguments,
        "racer.bench.llama_cpp:main",
    ),
    Command(
        "erase-corpus",
        "erase a tenant's corpus on every drafter and in Redis (needs the internal token)",
        erase_corpus_arguments,
        cmd_erase_corpus,
    ),
    Command(
        "prior",
        "compute a model's copy-logit prior (cached; shipped for the default model)",
        prior_arguments,
        cmd_prior,
    ),
    Command(
        "health",
        "exit 0 iff a service's grpc.health.v1 says SERVING (container health checks)",
        health_arguments,
        cmd_health,
    ),
)


def parser() -> argparse.ArgumentParser:
    # Its commands' flags for service settings (settings.add_flag) read their RACER_* variables as it parses.
    p = settings.CommandParser(prog="racer", description="RACER speculative decoding")
    sub = p.add_subparsers(dest="cmd", required=True)
    for c in COMMANDS:
        sp = sub.add_parser(c.name, help=c.help)
        c.arguments(sp)
        sp.set_defaults(command=c)
    return p


def _import(name: str, command: str):
    """``importlib.import_module``, with one line where the benchmarks are left out (the image)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in ("racer.bench", name) or not name.startswith("racer.bench"):
            raise
        raise FileNotFoundError(
            f"{command}: the benchmarks (racer/bench) are not installed here (the serving image leaves them "
            "out): run it from a checkout"
        ) from None


def run(command: Command, args: argparse.Namespace) -> int:
    if callable(command.run):
        return command.run(args)
    module, function = command.run.split(":")
    return getattr(_import(module, command.name), function)(args)


def _log_level() -> str:
    level = os.environ.get("RACER_LOG", "WARNING")
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise SettingError(f"RACER_LOG={level!r}: expected a logging level (DEBUG, INFO, WARNING, ERROR)")
    return level.upper()


def main(argv=None) -> int:
    try:
        logging.basicConfig(level=_log_level(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
        args = parser().parse_args(argv)
        return run(args.command, args)
    except (ValueError, FileNotFoundError) as e:  # SettingError included: one line naming the variable
        print(f"racer: {e}", file=sys.stderr)
        return 2
    except ServiceFailed as e:  # a service the command started exited: which, and why, in one line
        print(f"racer: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
