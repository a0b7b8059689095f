"""The whole pipeline in one process, no services: the target model and its tokenizer, and per prompt
one drafter session and one verifier session driven by ``common.loop.generate`` (the same rounds
the gateway drives). ``racer generate``, ``racer bench`` and the in-process side of the benchmarks
run on it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterator

import torch

from common import settings
from common.costs import ContextSlope, follow
from common.loop import Stats, generate
from common.params import GenerationParams, SamplingParams
from drafter.draft_session import DrafterConfig, DraftSession
from verifier.engine import VerifierSession
from verifier.gguf_blocks import kept
from verifier.model import DEFAULT_MODEL, GGUF, LoadedModel, load

# the prompt rows whose top-k the drafter gets, as a verifier service's default sends (None: all)
PROMPT_TOPK = settings.prompt_topk(settings.default("verifier", "--prompt-topk"))


@dataclass
class InProcessStack:
    loaded: LoadedModel
    drafter_config: DrafterConfig = field(default_factory=DrafterConfig)
    backend: str = settings.default("verifier", "--backend")
    prior: object = None  # [vocab, k] copy-logit prior shared by all sessions (verifier/prior.py)
    costs: dict | None = None  # verifier cost curve (ms by tree size) for the adaptive budget
    slope: ContextSlope | None = None  # what the context adds to it (None: not measured)
    # the prompt rows whose top-k the drafter gets, as a verifier service's default sends (None:
    # all); with the cost curve measured, at most as many as cost one one-token step, as the service's
    prompt_topk: int | None = PROMPT_TOPK
    # What a round costs outside the forward, as the adaptive budget counts it: a drafted round's
    # drafter step (the median of the last stream's, once one ran), and a round verified without a
    # tree (bookkeeping only, in one process).
    overhead_ms: float = 1.0
    plain_overhead_ms: float = 0.0

    @classmethod
    def load(
        cls,
        model: str = DEFAULT_MODEL,
        backend: str = settings.default("verifier", "--backend"),
        prior: bool = True,
        threads: int | None = None,
        dtype: str = settings.default("verifier", "--dtype"),
        **drafter,
    ) -> "InProcessStack":
        loaded = load(model, dtype=dtype, threads=threads, backend=backend)
        config = DrafterConfig(**drafter)
        table = None
        if prior:
            from verifier.prior import find_or_compute

            source = loaded.model
            if source.dtype != torch.float32:
                # The prior is a drafting hint that depends on the weights, not on the dtype they run in:
                # the float32 weights' prior (shipped for the default model) serves, instead of
                # computing it again through a reduced-precision forward.
                source = load(model, dtype="float32", tokenizer=False).model
            table = find_or_compute(source, loaded.tokenizer, config.topk)
            del source
        engine = cls(loaded, config, backend, table)
        engine.tune_kernels()
        return engine

    def tune_kernels(self) -> str | None:
        """The lean backend's kernel choice for this model, dtype and thread count (measured now, or
        read from the cache); a description of it, or None when the lean backend is not used."""
        from verifier.llama import LlamaBackend
        from verifier.tuning import kernel_plan

        if self.backend == "hf" or not LlamaBackend.supports(self.loaded.model):
            return None
        return kernel_plan(self.loaded.model).describe()

    @property
    def dtype(self) -> str:
        if kept(self.loaded.model) is not None:
            return GGUF
        return str(self.loaded.model.dtype).replace("torch.", "")

    def new_drafter(self) -> DraftSession:
        session = DraftSession(self.drafter_config, self.prior)
        if self.costs is not None:
            session.set_costs(self.costs, self.overhead_ms, self.plain_overhead_ms, self.slope)
        return session

    def measure_costs(self) -> dict[int, float]:
        """Measures the verifier's cost curve and its slope against the context (a few seconds);
        drafters made afterwards can use budget 0."""
        from verifier.engine import measure_cost_slope, measure_prompt_rows

        model, topk = self.loaded.model, self.drafter_config.topk
        self.costs, self.slope = measure_cost_slope(model, backend=self.backend, topk=topk)
        if self.prompt_topk:
            bound = measure_prompt_rows(model, self.costs[min(self.costs)], backend=self.backend, topk=topk)
            self.prompt_topk = self.prompt_topk if bound is None else min(self.prompt_topk, bound)
        return self.costs

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def reference_model(self):
        """A context holding the model as Hugging Face loaded it, for the HF baselines. The lean
        backend may store some projection weights transposed (``verifier/kernels.py``: the same
        values, another GEMM), which would also change which GEMM HF's own forward calls, and so
        its speed; a baseline must be HF as its users run it. The layouts come back afterwards."""
        from verifier.layouts import loaded_layout

        return loaded_layout(self.loaded.model)

    def stream(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        sampling: SamplingParams = SamplingParams(),
        stats: Stats | None = None,
        drafter: DraftSession | None = None,
    ) -> Iterator[list[int]]:
        drafter = drafter or self.new_drafter()
        verifier = VerifierSession(self.loaded.model, self.drafter_config.topk, self.backend, sampling)
        stats = stats if stats is not None else Stats()
        yield from generate(drafter, verifier, prompt_ids, params, stats, prompt_topk=self.prompt_topk)
        if stats.draft_step_s:
            self.overhead_ms = statistics.median(stats.draft_step_s) * 1e3
        if self.costs is not None:  # the next streams' curve follows what forwards take, as a verifier's does
            for n, length, ms in stats.forwards:
                follow(self.costs, self.slope, n, length, ms)

    def default_params(self, **kw) -> GenerationParams:
        kw.setdefault("stop_token_ids", self.loaded.eos_token_ids)
        return GenerationParams(**kw)
