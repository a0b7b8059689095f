"""``racer bench-llama-cpp``'s parts that run without llama.cpp: which file and endpoint it takes, how
it reads a streamed answer (time to the first token, usage, llama.cpp's timings) and what it reports."""

from __future__ import annotations

import http.server
import json
import threading
import time

import gguf
import numpy as np
import pytest

from racer.bench import llama_cpp as L
from verifier.model import default_gguf_path


def _write_gguf(path, chat_template: str | None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_endpoint_follows_the_files_chat_template(tmp_path):
    chat, base = tmp_path / "chat.gguf", tmp_path / "base.gguf"
    _write_gguf(chat, "{{ messages[0]['content'] }}")
    _write_gguf(base, None)
    assert L.has_chat_template(chat) and not L.has_chat_template(base)
    assert (L.choose_api("auto", chat), L.choose_api("auto", base)) == ("chat", "completions")
    assert L.choose_api("chat", base) == "chat" and L.choose_api("completions", chat) == "completions"
    assert L.has_chat_template(default_gguf_path())


def test_the_file_is_named_or_found_in_its_directory(tmp_path):
    assert L.gguf_file("default") == default_gguf_path()
    one = tmp_path / "one"
    one.mkdir()
    _write_gguf(one / "x.Q4_K_M.gguf", None)
    _write_gguf(one / "mmproj-x.gguf", None)  # a multimodal projector is not the model
    assert L.gguf_file(str(one)) == one / "x.Q4_K_M.gguf"
    assert L.gguf_file(str(one / "x.Q4_K_M.gguf")) == one / "x.Q4_K_M.gguf"
    _write_gguf(one / "y.Q8_0.gguf", None)
    with pytest.raises(ValueError, match="one .gguf file, not 2"):
        L.gguf_file(str(one))
    with pytest.raises(FileNotFoundError):
        L.gguf_file(str(tmp_path / "missing.gguf"))


def test_the_stacks_get_default_for_the_bundled_file_and_the_path_for_another(tmp_path):
    bundled = default_gguf_path()
    assert L.racer_model("default", bundled) == "default"
    assert L.racer_model(str(bundled), bundled) == "default"  # its prior and its cached conversion
    other = tmp_path / "x.gguf"
    _write_gguf(other, None)
    assert L.racer_model(str(other), other) == str(other)


class _SSE(http.server.BaseHTTPRequestHandler):
    """Streams ``events`` (None: a pause of ``PAUSE`` seconds) as server-sent events; keeps the body."""

    events: list = []
    bodies: list = []
    PAUSE = 0.2

    def do_POST(self):  # noqa: N802 - http.server's name
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for ev in self.events:
            if ev is None:
                time.sleep(self.PAUSE)
                continue
            self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def sse():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_chat_stream_times_its_first_token_not_its_opening_delta(sse):
    timings = {"prompt_n": 10, "prompt_ms": 40.0, "predicted_n": 3, "predicted_ms": 30.0}
    _SSE.events = [
        {"choices": [{"delta": {"role": "assistant", "content": None}}]},
        None,  # the prefill
        {"choices": [{"delta": {"content": "Hel"}}]},
        {"choices": [{"delta": {"content": "lo"}}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}], "timings": timings},
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3}},
    ]
    a = L._stream(sse + "/v1/chat/completions", {"messages": []})
    assert (a.text, a.prompt_tokens, a.tokens, a.server) == ("Hello", 10, 3, timings)
    assert _SSE.PAUSE <= a.first <= a.seconds
    assert _SSE.bodies[-1]["stream"] is True and _SSE.bodies[-1]["stream_options"] == {"include_usage": True}


def test_a_completions_stream_counts_a_token_without_text(sse):
    """racer's chunks carry token ids even when a token's text is not whole yet."""
    _SSE.events = [
        None,
        {"choices": [{"text": "", "token_ids": [7]}]},
        {"choices": [{"text": "é", "token_ids": [8]}]},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
    ]
    a = L._stream(sse + "/v1/completions", {"prompt": "x"})
    assert (a.text, a.prompt_tokens, a.tokens, a.server) == ("é", 4, 2, {})
    assert _SSE.PAUSE <= a.first <= a.seconds


def test_an_error_event_fails_the_request(sse):
    _SSE.events = [{"error": {"message": "no chat template"}}]
    with pytest.raises(RuntimeError, match="no chat template"):
        L._stream(sse + "/v1/chat/completions", {"messages": []})


def test_the_tables_split_prefill_from_decoding_and_compare_answers():
    def answer(text, tokens, seconds, first, server=None):
        return L.Answer(text, 100, tokens, seconds, first, server or {})

    timed = {"prompt_n": 100, "prompt_ms": 500.0, "predicted_n": 9, "predicted_ms": 90.0}
    results = {
        "llama.cpp plain": [answer("a", 10, 1.0, 0.5, timed), answer("b", 10, 1.0, 0.5, timed)],
        "racer gguf off": [answer("a", 10, 0.5, 0.25), answer("c", 10, 0.5, 0.25)],
        "racer gguf racer": [answer("a", 10, 0.4, 0.25), answer("c", 10, 0.4, 0.25)],
    }
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in L.speed_table(results, "racer gguf off").splitlines()[2:]
    }
    # tok/s, median, x plain, median TTFT ms, prefill tok/s, decode tok/s, llama.cpp's own, equal
    assert rows["llama.cpp plain"][1:8] == ["10.0", "10.0", "1.00", "500", "200", "18.0", "200 / 100.0"]
    assert rows["llama.cpp plain"][8].strip(" |") == "1/2 racer gguf off"
    assert rows["racer gguf off"][1:7] == ["20.0", "20.0", "2.00", "250", "400", "36.0"]
    assert rows["racer gguf racer"][8].strip(" |") == "2/2 gguf off"
    server = L.Server("racer gguf", [], 12.5, [], 3.0, {"rss": 300 << 20, "file": 100 << 20, "peak": 400 << 20})
    assert "| racer gguf | 12.5 | 3.0 | 300 | 100 | 400 | 3.0 |" in L.server_table([server], 100 << 20)
