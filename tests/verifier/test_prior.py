"""The copy-logit prior: the model's own top-k after each token in a neutral context."""

import numpy as np
import pytest
import torch

from drafter.copy_logits import CopyLogitTable
from drafter.draft_session import DraftSession
from verifier.prior import compute_prior, find_or_compute


def test_prior_rows_equal_a_plain_forward(tiny_llama):
    prefix = [1, 7, 9]
    table = compute_prior(tiny_llama, prefix, topk=4, chunk=37)  # chunk not dividing the vocab
    assert table.shape == (tiny_llama.config.vocab_size, 4)
    for t in (0, 3, 36, 37, 38, 95):
        with torch.inference_mode():
            logits = tiny_llama(torch.tensor([prefix + [t]])).logits[0, -1]
        assert table[t].tolist() == torch.topk(logits, 4).indices.tolist(), t


def test_prior_is_cached_by_weights(tiny_llama, tmp_path):
    class Tok:
        chat_template = None
        bos_token_id = 1

    first = find_or_compute(tiny_llama, Tok(), 3, cache_dir=tmp_path)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".npy"
    again = find_or_compute(tiny_llama, Tok(), 3, cache_dir=tmp_path, compute=False)
    assert np.array_equal(first, again)
    assert find_or_compute(tiny_llama, Tok(), 5, cache_dir=tmp_path, compute=False) is None  # other k


def test_table_prefers_session_rows_over_the_prior():
    prior = np.arange(40, dtype=np.uint32).reshape(10, 4)
    table = CopyLogitTable(k=3, prior=prior)
    assert table.get(2) == (8, 9, 10)
    table.put(2, [5, 5, 5, 5])
    assert table.get(2) == (5, 5, 5)
    assert table.get(10) == ()  # outside the prior
    assert len(table) == 1  # prior rows are not copied into the session


def test_prior_feeds_the_logits_tree_of_an_unseen_root():
    prior = np.zeros((50, 8), dtype=np.uint32)
    prior[42, :3] = [7, 8, 9]
    plain = DraftSession().draft(42, 8, "logits")
    primed = DraftSession(prior=prior).draft(42, 8, "logits")
    assert plain.tokens == (42,)
    assert primed.tokens[:4] == (42, 7, 8, 9)


@pytest.mark.slow
def test_shipped_prior_matches_the_default_model(default_model):
    from verifier.prior import SHIPPED, fingerprint, neutral_prefix

    model, tok = default_model.model, default_model.tokenizer
    path = SHIPPED / f"prior-{fingerprint(model)}-k8.npy"
    assert path.exists(), f"no shipped prior for these weights ({path.name}); run: racer prior --out common/data"
    table = np.load(path)
    assert table.shape == (model.config.vocab_size, 8)
    prefix = neutral_prefix(tok)
    for t in (0, 2, 198, 1000, 4093, 28120, 49151):
        with torch.inference_mode():
            logits = model(torch.tensor([prefix + [t]])).logits[0, -1]
        want = torch.topk(logits, 8).indices.tolist()
        assert table[t][0] == want[0], t  # the argmax exactly; lower ranks may swap on near-ties
        assert len(set(table[t].tolist()) & set(want)) >= 6, t
