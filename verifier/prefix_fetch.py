"""Prefix blocks moved between verifiers: what a block must prove before another verifier uses it.

A tenant's new session placed on a verifier that lacks its prompt's leading blocks (the holder was
saturated, or this verifier just joined) may fetch them from the verifier the gateway names as
their holder (``VerifierOpen.prefix_source``, ``Verifier.PrefixBlocks``) instead of prefilling
them. Nothing here does I/O: the transport is ``verifier/service.py``'s, the use is
``sessions.Verifier.open``'s.

When. A fetch is made when it is cheaper than the prefill it saves, as measured here (``Rates``):

    fetch if  setup + bytes / transfer rate  <  tokens x prefill seconds per token

``bytes``: the blocks' rows (``kv_memory.kv_bytes_per_token`` x block tokens each); the transfer
rate and setup time (request to header) are averages of this verifier's own transfers, the
prefill time per token an average of its own prefills of at least a block. Unmeasured, a side
counts as favourable to the fetch: the first fetch measures the link, bounded like every fetch by
a deadline (``--prefix-fetch-seconds``, and the client's own) and a byte budget
(``--prefix-fetch-bytes``, and the free KV memory the received blocks will hold).

Other uses of the same transfer. A session moving off a draining verifier (a hand-over:
``Ask.session``) is named to its next verifier with the draining one as the source; that one sends
the blocks its prefix cache holds, then the session's own committed rows read from its KV cache, as
blocks of the same chain keys, so the receiver checks them exactly as prefix blocks. A verifier
that joins is warmed (``Ask.hottest``): the holder sends its most recently used chains, any scope,
each block with its tokens and its parent's key; the receiver recomputes each key from them
(``common.prefix.child_key``), which takes the place of its own prompt's keys.

What is checked. Every check that fails discards the whole transfer, and the open prefills:

* scope: the holder serves only blocks cached under the scope the request names (set from the
  gateway's open, never by a client), and the receiver takes only blocks whose scope and chain key
  (``common/prefix.py``: a hash chain over the scope and the token ids) are its own for its prompt;
* fingerprint: both sides compute ``fingerprint`` (the model file's identity, dtype, backend,
  kernel plan, attention path, the CPU's vector level and the native build, threads, block size);
  blocks move only between equal ones, since rows computed along another kernel path are not bit
  for bit the rows a prefill here would write;
* hash: each block carries ``link(previous digest, key, rows)``, the first chained from the
  fingerprint and the scope; the receiver recomputes the chain over what it got;
* deadline, budget: a transfer past its deadline or its bytes is dropped; a source that fails, ends
  early or sends a block out of order counts as ``source``.

Faults for tests (``RACER_PREFIX_FAULT``, comma-separated, read when a verifier starts): a holder
with ``ignore-scope`` serves blocks of any scope whose tokens match; ``corrupt`` flips a byte of
each block's rows after digesting them; ``stop-mid-transfer`` stops its own process (SIGSTOP)
after sending a transfer's first block.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REASONS = ("scope", "fingerprint", "hash", "deadline", "budget", "source")
# What a transfer is for: a new session's prefix (fetch), a moving session's rows off a draining
# verifier (handover), or a joining verifier's prefix cache (warm).
USES = ("fetch", "handover", "warm")
FAULTS = ("ignore-scope", "corrupt", "stop-mid-transfer")
DIGEST = 32


def faults() -> frozenset[str]:
    """``RACER_PREFIX_FAULT``'s faults; ValueError naming the known ones for another."""
    asked = {f.strip() for f in os.environ.get("RACER_PREFIX_FAULT", "").split(",") if f.strip()}
    unknown = sorted(asked - set(FAULTS))
    if unknown:
        raise ValueError(f"RACER_PREFIX_FAULT: unknown {unknown} (one of {', '.join(FAULTS)})")
    return frozenset(asked)


class Refused(Exception):
    """A transfer that is not used; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Ask:
    """What a receiver asks a holder for: the blocks ``first`` .. of ``tokens`` (full blocks only)."""

    tenant: str
    scope: str
    tokens: list[int]
    first: int
    block: int
    fingerprint: str
    max_bytes: int
    session: str = ""  # a hand-over: this session's own rows past the prefix cache's blocks
    hottest: bool = False  # a warm-up: the holder's most recently used chains, no tokens asked


@dataclass(frozen=True)
class Header:
    fingerprint: str
    blocks: int
    block_bytes: int


@dataclass(frozen=True)
class WireBlock:
    index: int
    key: bytes
    scope: str
    rows: bytes
    digest: bytes
    tokens: tuple[int, ...] = ()  # a warm-up's: the block's tokens
    parent: bytes = b""  # a warm-up's: the parent's key (b"": a chain's first block)


def seed(fingerprint: str, scope: str) -> bytes:
    """The digest the chain starts from."""
    return hashlib.blake2b(f"{fingerprint}\x00{scope}".encode(), digest_size=DIGEST).digest()


def link(prev: bytes, key: bytes, rows: bytes) -> bytes:
    h = hashlib.blake2b(prev, digest_size=DIGEST)
    h.update(key)
    h.update(rows)
    return h.digest()


# -- rows as bytes -----------------------------------------------------------------------------------


def pack(rows) -> bytes:
    """A block's rows (a tensor, or per layer a (keys, values) pair, as ``read_rows`` gives them) as
    their raw bytes, tensor after tensor."""
    return b"".join(_raw(t) for t in _tensors(rows))


def _tensors(rows) -> list[torch.Tensor]:
    if isinstance(rows, torch.Tensor):
        return [rows]
    return [t for pair in rows for t in pair]


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class Layout:
    """How a block's rows are shaped here: ``pairs`` (the hf backend: per layer keys and values) or
    one tensor (the llama backend), each of ``shape`` in ``dtype``."""

    pairs: bool
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(_numel(s) for s in self.shapes) * size

    def describe(self) -> str:
        return f"{'pairs' if self.pairs else 'tensor'} {list(self.shapes)} {str(self.dtype).replace('torch.', '')}"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layout(config, backend: str, dtype: torch.dtype, block: int) -> Layout:
    """A block's rows on ``backend`` ("llama": [layers, 2, kv_heads, block, head_dim]; "hf": per layer
    keys and values [1, kv_heads, block, head_dim])."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    if backend == "llama":
        return Layout(False, ((layers, 2, kv, block, dim),), dtype)
    return Layout(True, ((1, kv, block, dim),) * (2 * layers), dtype)


def unpack(data: bytes, lay: Layout):
    """``pack``'s inverse for rows of ``lay`` (``Refused("hash")`` for a wrong length)."""
    if len(data) != lay.nbytes:
        raise Refused("hash", f"a block of {len(data)} bytes, {lay.nbytes} expected")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out, at = [], 0
    for shape in lay.shapes:
        n = _numel(shape) * torch.empty((), dtype=lay.dtype).element_size()
        out.append(flat[at : at + n].view(lay.dtype).reshape(shape))
        at += n
    if not lay.pairs:
        return out[0]
    return [(out[i], out[i + 1]) for i in range(0, len(out), 2)]


# -- what computed the rows --------------------------------------------------------------------------


def model_identity(model) -> dict:
    """The model as files: each weight file's name, size and a digest of its first and last MiB
    (its header and its end), with the configuration; a model not loaded from files (built in
    memory): a digest of its parameters."""
    cfg = model.config.to_dict()
    skip = ("transformers_version", "torch_dtype", "dtype")
    config = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in skip}
    files = []
    gguf = getattr(model, "_racer_gguf_file", None) or (getattr(model, "_racer_gguf", None) or {}).get("path")
    source = Path(gguf) if gguf else Path(str(cfg.get("_name_or_path") or ""))
    paths = [source] if source.is_file() else []
    if str(source) and source.is_dir():
        paths = sorted(p for p in source.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    for p in paths:
        files.append([p.name, p.stat().st_size, _ends_digest(p)])
    ident = {"config": json.loads(json.dumps(config, sort_keys=True, default=str)), "files": files}
    if not files:
        h = hashlib.blake2b(digest_size=16)
        for name, t in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(_raw(t.float() if t.dtype not in (torch.float32, torch.bfloat16, torch.float16) else t))
        ident["parameters"] = h.hexdigest()
    return ident


def _ends_digest(path: Path, span: int = 1 << 20) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(span))
        size = path.stat().st_size
        if size > span:
            f.seek(max(span, size - span))
            h.update(f.read(span))
    return h.hexdigest()


def fingerprint(model, setup, lay: Layout, block: int) -> tuple[str, dict]:
    """(digest, what it digests) of what a verifier's rows depend on: see the module's docstring."""
    from . import machine, native

    held = getattr(model, "_racer_kernels", None)
    plan = held[1] if held is not None else None
    cpu = machine.fingerprint()
    cpu.pop("cpu", None)  # the model name: CPUs of one vector level compute alike
    attention = ""
    if setup.backend == "llama" and native.attention_usable(lay.dtype, torch.device("cpu"), lay.shapes[0][-1]):
        cfg = model.config
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        attention = native.attention_path(lay.dtype, heads, kv, lay.shapes[0][-1])
    what = {
        "model": model_identity(model),
        "dtype": setup.dtype,
        "backend": setup.backend,
        "rows": lay.describe(),
        "block": block,
        # the choices, not where they came from (tuned now or read from the plan cache), but forced apart
        "kernels": None
        if plan is None
        else [plan.describe().replace(f", {plan.source})", ")"), "forced" if plan.source == "forced" else "measured"],
        "attention": attention,
        "native": [setup.native_isa_level, setup.native_quant_isa, setup.native_vector_bits],
        "refused": sorted(c.kernel for c in setup.kernel_checks if not c.ok),
        "cpu": cpu,
        "threads": torch.get_num_threads(),
    }
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return digest, what


# -- the rule ----------------------------------------------------------------------------------------


class Rates:
    """This verifier's measured costs: prefill seconds per token, a transfer's setup seconds and its
    bytes per second; exponential averages (``weight``) of what it saw. None: not measured yet."""

    def __init__(self, weight: float = 0.3):
        self.weight = weight
        self.prefill_per_token: float | None = None
        self.setup_seconds: float | None = None
        self.bytes_per_second: float | None = None

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_per_token = self._avg(self.prefill_per_token, seconds / tokens)

    def fetched(self, nbytes: int, setup: float, seconds: float) -> None:
        self.setup_seconds = self._avg(self.setup_seconds, max(0.0, setup))
        if nbytes > 0 and seconds > setup:
            self.bytes_per_second = self._avg(self.bytes_per_second, nbytes / (seconds - setup))

    def fetch_seconds(self, nbytes: int) -> float | None:
        if self.bytes_per_second is None:
            return None
        return (self.setup_seconds or 0.0) + nbytes / self.bytes_per_second

    def prefill_seconds(self, tokens: int) -> float | None:
        return None if self.prefill_per_token is None else tokens * self.prefill_per_token

    def worth(self, tokens: int, nbytes: int) -> bool:
        """Whether fetching ``nbytes`` of rows beats prefilling their ``tokens`` (unmeasured: yes)."""
        fetch, prefill = self.fetch_seconds(nbytes), self.prefill_seconds(tokens)
        return fetch is None or prefill is None or fetch < prefill


class Clock:
    """Seconds since it was made (a transfer's setup and length)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
