"""MMCA (slipstream.multimodal.mmca_attention) against per-query fp64 references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slipstream.models.gpt import CausalAttention
from slipstream.multimodal import IMAGE, PAD, TEXT, mmca_attention


def _random_layout(b: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of text with 1-3 image runs inside and left or right padding (never empty)."""
    rows = []
    for r in range(b):
        types = torch.full((length,), TEXT)
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            start = int(torch.randint(0, length - 3, (1,), generator=gen))
            types[start : start + int(torch.randint(1, 4, (1,), generator=gen))] = IMAGE
        pad = int(torch.randint(0, 4, (1,), generator=gen))
        if pad:
            types[:pad] = PAD if r % 2 else types[:pad]
            types[-pad:] = types[-pad:] if r % 2 else PAD
        rows.append(types)
    return torch.stack(rows)


def _naive(q, k, v, types, mode="paper"):  # type: ignore[no-untyped-def]
    """Per query, per head, written from the paper's formulas (paper) or plain causal."""
    b, h, lq, d = q.shape
    lk, rep = k.shape[2], h // k.shape[1]
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=q.dtype)
    for bi in range(b):
        for i in range(lq):
            p = lk - lq + i
            tq = int(types[bi, p])
            for hi in range(h):
                kk, vv = k[bi, hi // rep], v[bi, hi // rep]
                s = kk @ q[bi, hi, i] / math.sqrt(d)
                if tq == PAD:
                    continue
                if mode == "causal":
                    sets = [[j for j in range(p + 1) if types[bi, j] != PAD]]
                elif tq == IMAGE:
                    out[bi, hi, i] = vv[p]
                    continue
                else:
                    text = [j for j in range(p + 1) if types[bi, j] == TEXT]
                    image = [j for j in range(p) if types[bi, j] == IMAGE]
                    sets = [text, image]
                for js in sets:
                    if js:
                        out[bi, hi, i] += torch.softmax(s[js], 0) @ vv[js]
    return out


def _released(q, k, v, types):  # type: ignore[no-untyped-def]
    """The released mask construction transcribed element by element (float64 softmax)."""
    b, h, lq, d = q.shape
    lk, past = k.shape[2], k.shape[2] - q.shape[2]
    fmin = torch.finfo(q.dtype).min
    img = torch.zeros(b, lq, lk, dtype=q.dtype)
    txt = torch.zeros(b, lq, lk, dtype=q.dtype)
    for bi in range(b):
        for j in range(lk):
            img[bi, :, j] = 0.0 if types[bi, j] == IMAGE else fmin
            txt[bi, :, j] = 0.0 if types[bi, j] == TEXT else fmin
        if lq == lk:
            for i in range(lq):
                if types[bi, i] == IMAGE:
                    img[bi, i, :] = fmin
                    img[bi, i, i] = 0.0
    if lq > 1:
        causal = torch.full((lq, lk), fmin, dtype=q.dtype)
        for i in range(lq):
            causal[i, : past + i + 1] = 0.0
        img, txt = img + causal, txt + causal  # fmin + fmin overflows to -inf
    rep = h // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(d)
    w = torch.softmax(s + img[:, None], -1) + torch.softmax(s + txt[:, None], -1)
    return w @ vv


def _qkv(b=3, h=4, hkv=2, lq=20, lk=20, d=8, dtype=torch.float64, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    return q, k, v, _random_layout(b, lk, g)


@pytest.mark.parametrize("mode", ["paper", "causal"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_naive_per_query_reference_fp64(mode: str, seed: int) -> None:
    q, k, v, types = _qkv(seed=seed)
    assert (types == IMAGE).any() and (types == PAD).any()
    torch.testing.assert_close(mmca_attention(q, k, v, types, mode), _naive(q, k, v, types, mode))


def test_no_image_tokens_is_standard_causal_attention_bitwise() -> None:
    q, k, v, _ = _qkv(dtype=torch.float32)
    types = torch.full((3, 20), TEXT)
    expected = CausalAttention()(q, k, v).transpose(1, 2)
    assert torch.equal(mmca_attention(q, k, v, types), expected)
    assert torch.equal(mmca_attention(q, k, v, types, "causal"), expected)


def test_no_image_tokens_with_padding_is_key_padded_causal_attention() -> None:
    q, k, v, _ = _qkv()
    types = torch.full((3, 20), TEXT)
    types[0, :5] = PAD  # left padding
    keep = torch.ones(20, 20, dtype=torch.bool).tril() & (types != PAD)[:, None, None, :]
    expected = (
        F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=keep
        )
        * (types != PAD)[:, None, :, None]
    )
    torch.testing.assert_close(mmca_attention(q, k, v, types), expected)


def test_weights_obey_the_paper_invariants() -> None:
    """With v = identity the output rows are the attention weights themselves."""
    q, k, _, types = _qkv(b=2, h=2, hkv=2, lq=16, lk=16, seed=3)
    types[0] = torch.tensor([1, 1, 1, 2, 2, 1, 1, 2, 2, 2, 1, 1, 0, 0, 0, 0])
    eye = torch.eye(16, dtype=q.dtype).expand(2, 2, 16, 16)
    w = mmca_attention(q, k, eye, types)[0, 0]
    t = types[0]
    for i in range(16):
        if t[i] == IMAGE:  # (1) one nonzero weight, on the diagonal
            assert torch.equal(w[i], torch.eye(16, dtype=w.dtype)[i])
        elif t[i] == TEXT:  # (2) per-modality sums of 1 (0 with no earlier image)
            text_sum = w[i][(t == TEXT)].sum()
            image_sum = w[i][(t == IMAGE)].sum()
            torch.testing.assert_close(text_sum, torch.tensor(1.0, dtype=w.dtype))
            want = 1.0 if (t[:i] == IMAGE).any() else 0.0
            torch.testing.assert_close(image_sum, torch.tensor(want, dtype=w.dtype))
            # (3) zero weight on future positions and padding, also before the first image
            assert (w[i, i + 1 :] == 0).all() and (w[i][t == PAD] == 0).all()
        else:
            assert (w[i] == 0).all()


def test_reference_code_reproduces_the_released_arithmetic() -> None:
    for dtype in (torch.float64, torch.float32):
        q, k, v, types = _qkv(dtype=dtype, seed=4)
        types[0, :6] = torch.tensor([TEXT, TEXT, TEXT, IMAGE, IMAGE, TEXT])
        got = mmca_attention(q, k, v, types, "reference_code")
        torch.testing.assert_close(got, _released(q, k, v, types))
        # decode passes: several new queries, then one (no causal mask in the released code)
        for lq in (5, 1):
            got = mmca_attention(q[:, :, -lq:], k, v, types, "reference_code")
            torch.testing.assert_close(got, _released(q[:, :, -lq:], k, v, types))


def test_reference_code_rows_sum_to_two_and_leak_future_images() -> None:
    q, k, _, _ = _qkv(b=1, h=2, hkv=1, lq=8, lk=8, seed=5)
    types = torch.tensor([[TEXT, TEXT, TEXT, IMAGE, IMAGE, TEXT, IMAGE, TEXT]])
    ones = torch.ones(1, 1, 8, 1, dtype=q.dtype)
    sums = mmca_attention(q, k, ones, types, "reference_code")[0, :, :, 0]
    image_rows = (types[0] == IMAGE).nonzero().squeeze(1)
    torch.testing.assert_close(sums[:, image_rows], torch.full((2, 3), 2.0, dtype=q.dtype))
    eye = torch.eye(8, dtype=q.dtype).expand(1, 1, 8, 8)
    w_ref = mmca_attention(q, k, eye, types, "reference_code")[0, 0]
    w_paper = mmca_attention(q, k, eye, types, "paper")[0, 0]
    assert w_ref[1, 3] > 0.1 and w_ref[1, 6] > 0.1  # text before the first image sees them
    assert w_paper[1, 3] == 0 and w_paper[1, 6] == 0
    torch.testing.assert_close(sums[:, 1], torch.full((2,), 2.0, dtype=q.dtype))


@pytest.mark.parametrize("mode", ["paper", "reference_code", "causal"])
def test_gradients_match_reference_autograd(mode: str) -> None:
    q, k, v, types = _qkv(b=2, lq=12, lk=12, seed=6)
    reference = _released if mode == "reference_code" else lambda *a: _naive(*a, mode=mode)
    grads = []
    for fn in (lambda *a: mmca_attention(*a, mode=mode), reference):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, types)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


def test_gradcheck_paper_mode() -> None:
    q, k, v, types = _qkv(b=1, h=2, hkv=1, lq=7, lk=7, d=3, seed=7)
    types[0] = torch.tensor([TEXT, IMAGE, IMAGE, TEXT, TEXT, IMAGE, TEXT])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: mmca_attention(a, b, c, types), leaves, fast_mode=True
    )


@pytest.mark.parametrize("mode", ["paper", "causal"])
def test_kv_cache_decoding_equals_full_recomputation(mode: str) -> None:
    """Queries appended one (or three) at a time against cached keys equal the full pass."""
    q, k, v, types = _qkv(lq=20, lk=20, seed=8)
    full = mmca_attention(q, k, v, types, mode)
    start = 10
    pieces = [mmca_attention(q[:, :, :start], k[:, :, :start], v[:, :, :start],
                             types[:, :start], mode)]  # fmt: skip
    t = start
    for step in (1, 3, 1, 1, 4):
        end = t + step
        pieces.append(mmca_attention(q[:, :, t:end], k[:, :, :end], v[:, :, :end],
                                     types[:, :end], mode))  # fmt: skip
        t = end
    assert t == 20
    torch.testing.assert_close(torch.cat(pieces, dim=2), full)


def test_bad_inputs_name_the_problem() -> None:
    q, k, v, types = _qkv()
    with pytest.raises(ValueError, match="mode='flash'"):
        mmca_attention(q, k, v, types, "flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token_types must be an integer tensor"):
        mmca_attention(q, k, v, types[:, :5])
    with pytest.raises(ValueError, match="divisible by the kv head count"):
        mmca_attention(q[:, :3], k, v, types)
    with pytest.raises(ValueError, match="Lq <= Lk"):
        mmca_attention(q, k[:, :, :5], v[:, :, :5], types[:, :5])
