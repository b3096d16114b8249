"""Post-training quantization: ZeroQuant-HERO (INT8 W8A8) and ZeroQuant-FP (FP8/FP4, LoRC).

Apply in place with :func:`quantize_`; see ``docs/quantization.md``::

    from slipstream.quant import W8A8Int, quantize_
    quantize_(model, W8A8Int())          # every nn.Linear except lm_head -> int8 GEMMs
"""

from slipstream.quant._formats import (
    E2M1,
    E4M3,
    E5M2,
    FPFormat,
    dequantize_int,
    fp4_decode,
    fp4_encode,
    fp4_pack,
    fp4_unpack,
    fp_round,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
)
from slipstream.quant._weights import (
    constrain_group_scales,
    dequantize_group_weight,
    expand_group_weight,
    quantize_group_weight,
)
from slipstream.quant.api import (
    calibrate,
    load_quantized,
    quantize_,
    register_handler,
    save_quantized,
)
from slipstream.quant.attention import (
    Int8Attention,
    int8_attention,
    int8_bmm,
    quantize_attention_,
    quantize_softmax,
)
from slipstream.quant.config import (
    HERO_PRESETS,
    W4A8FP4,
    W8A8FP8,
    HeroModes,
    QuantConfig,
    W4A8Int4,
    W8A8Int,
    hero_preset,
)
from slipstream.quant.eval import mean_cosine, perplexity
from slipstream.quant.hero import attach_norm_quant_, layer_norm_quant, rms_norm_quant, smooth_
from slipstream.quant.linear import QuantLinear
from slipstream.quant.lorc import lorc_factors

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "HERO_PRESETS",
    "W4A8FP4",
    "W8A8FP8",
    "FPFormat",
    "HeroModes",
    "Int8Attention",
    "QuantConfig",
    "QuantLinear",
    "W4A8Int4",
    "W8A8Int",
    "attach_norm_quant_",
    "calibrate",
    "constrain_group_scales",
    "dequantize_group_weight",
    "dequantize_int",
    "expand_group_weight",
    "fp4_decode",
    "fp4_encode",
    "fp4_pack",
    "fp4_unpack",
    "fp_round",
    "hero_preset",
    "int8_attention",
    "int8_bmm",
    "layer_norm_quant",
    "load_quantized",
    "lorc_factors",
    "mean_cosine",
    "perplexity",
    "quantize_",
    "quantize_attention_",
    "quantize_group_weight",
    "quantize_per_channel",
    "quantize_per_tensor",
    "quantize_per_token",
    "quantize_softmax",
    "register_handler",
    "rms_norm_quant",
    "save_quantized",
    "smooth_",
]
