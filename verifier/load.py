"""How saturated a verifier is: one number that autoscalers and gateways act on.

    saturation = max(kv_reserved / kv_memory / KV_TARGET, (model_queue + admission_waiting) / QUEUE_TARGET)

1.0 means saturated: KV reservations at ``KV_TARGET`` (80%) of KV memory, or ``QUEUE_TARGET`` (5)
jobs waiting, counting forwards queued for the model thread (prefill chunks, tree batches) and opens
waiting for KV memory. Those are the two limits of a verifier: memory for caches and the model's
time. The thresholds are llm-d's (a replica is saturated at KV usage >= 0.8 or queue >= 5); vLLM's
production stack scales on waiting requests at 5 too. Below 1 a verifier takes more sessions
without slowing the others much; above it, new sessions wait (for memory or for the model).

The same expression, on the exported gauges, is the PrometheusRule's ``racer:verifier_saturation``
(``k8s/components/saturation``), which KEDA or the HPA scale on; the verifier exports its own value
as ``racer_verifier_saturation`` and reports it to gateways in ``Stats`` (placement of new sessions).
Idle caches count in ``kv_reserved`` until they are evicted: a verifier full of idle sessions reads
as saturated, which is right for their next turns (they would otherwise be re-prefilled).
"""

from __future__ import annotations

KV_TARGET = 0.8  # fraction of KV memory reserved at which a verifier counts as saturated
QUEUE_TARGET = 5  # jobs waiting (model queue + admission queue) at which it counts as saturated


def saturation(kv_reserved: float, kv_memory: float, model_queue: int, admission_waiting: int) -> float:
    kv = kv_reserved / kv_memory / KV_TARGET if kv_memory > 0 else 0.0
    return max(kv, (model_queue + admission_waiting) / QUEUE_TARGET)


def of(verifier) -> float:
    """``verifier``'s saturation now (a ``verifier.sessions.Verifier``). The prefix cache's blocks
    do not count: they only fill free memory and are given back first when a session needs it."""
    b = verifier.kv_memory
    return saturation(b.used - verifier.prefix_bytes, b.total, verifier.model_thread.queued, b.waiting)
