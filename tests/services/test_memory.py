"""Memory under repeated identical load: what a wave of sessions held is gone once they are."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from tests.support.engine import hf_greedy
from tests.support.stack import start_stack, wait_until
from tests.support.tinytok import make_char_tokenizer
from verifier import heap

MODEL = "tiny-llama"


def test_identical_waves_leave_the_verifier_as_idle_as_before_and_its_heap_trimmed(loop_thread, tiny_llama):
    """Three waves of 8 concurrent one-call chat requests: after each, the verifier holds no KV cache,
    no KV memory is reserved (the value it had idle), and it handed its free heap back once idle
    (the trims counter, read as the sync point: nothing is timed). Each answer is as alone."""
    tok = make_char_tokenizer(96)
    st = start_stack(loop_thread, tiny_llama, tokenizer=tok, http_port=-1, served_model_name=MODEL)
    core = st.verifiers[0][1]
    url = f"http://127.0.0.1:{st.gateway_pair[0].http_port}/v1"
    prompts = [[{"role": "user", "content": f"Wave item {i}."}] for i in range(8)]
    from common.text import messages_ids

    refs = [tok.decode(hf_greedy(tiny_llama, messages_ids(tok, m), 12), skip_special_tokens=True) for m in prompts]
    idle = (len(core.sessions), core.kv_memory.used)
    assert idle == (0, 0)

    def call(i: int) -> str:
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as c:
            r = c.chat.completions.create(model=MODEL, messages=prompts[i], stream=True, max_tokens=12, temperature=0)
            return "".join(ch.choices[0].delta.content or "" for ch in r)

    try:
        for wave in range(3):
            trims = heap.TRIMS._value.get()
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(call, range(8))) == refs, f"wave {wave}"
            wait_until(
                lambda: (len(core.sessions), core.kv_memory.used) == idle,
                timeout=60,
                what=f"the verifier idle again after wave {wave}",
            )
            if heap.stats() is not None:  # glibc
                wait_until(lambda: heap.TRIMS._value.get() > trims, timeout=60, what=f"a trim after wave {wave}")
                assert heap.HEAP_BYTES._value.get() > 0
    finally:
        st.stop()
