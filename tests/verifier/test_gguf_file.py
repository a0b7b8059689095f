"""``verifier/gguf_file.py``: a GGUF file's tensors found by walking its metadata's lengths only, the
same names, formats, shapes and bytes gguf's own reader finds, past metadata of every kind (string
arrays, nested arrays, a non-default alignment)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import quants

from verifier.gguf_file import tensors


def _write(path, alignment: int | None = None) -> None:
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "tiny ünïcode")
    w.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<|im_end|>"] * 50)
    w.add_array("tokenizer.ggml.scores", [0.5] * 200)
    w.add_array("nested", [[1, 2, 3], [4]])
    w.add_uint32("llama.block_count", 2)
    w.add_float64("some.float", 1.25)
    w.add_bool("some.flag", True)
    w.add_tensor("token_embd.weight", rng.standard_normal((40, 64)).astype(np.float32))
    w.add_tensor(
        "blk.0.attn_q.weight",
        quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.add_tensor(
        "blk.0.ffn_down.weight",
        quants.quantize(rng.standard_normal((16, 256)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0),
        raw_dtype=gguf.GGMLQuantizationType.Q4_0,
    )
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_tensors_are_the_ones_ggufs_reader_finds(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    mine = tensors(path)
    theirs = gguf.GGUFReader(str(path)).tensors
    assert sorted(mine) == sorted(t.name for t in theirs) and len(theirs) == 4
    for t in theirs:
        m = mine[t.name]
        assert m.kind == t.tensor_type.name
        assert m.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(m.data, np.asarray(t.data).view(np.uint8).reshape(-1))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        tensors(path)


def test_the_conversion_parses_a_file_once_and_puts_ggufs_reader_back(tmp_path):
    from verifier.model import _one_parse

    path = tmp_path / "m.gguf"
    _write(path)
    real, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _one_parse():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first  # str or Path: one parse
        assert sorted(t.name for t in first.tensors) == sorted(tensors(path))
    assert gguf.GGUFReader is real and gguf.get_tensor_name_map is real_map
    assert gguf.GGUFReader(str(path)) is not first
