"""FP8 quantization for fp8rl_jax: block-scaled weights, per-token-group activations.

The math lives in `fp8rl_jax.numerics.fp8` (see its design note); this package
re-exports the public API.
"""

from fp8rl_jax.numerics.fp8 import (
    E4M3_MAX,
    E5M2_MAX,
    Fp8Format,
    QuantizedWeight,
    ScaleRounding,
    count_nonfinite,
    dequantize_activations,
    dequantize_weight,
    quantize_activations,
    quantize_activations_t,
    quantize_weight_blockwise,
    quantize_weight_checked,
    saturating_cast,
)

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "Fp8Format",
    "QuantizedWeight",
    "ScaleRounding",
    "count_nonfinite",
    "dequantize_activations",
    "dequantize_weight",
    "quantize_activations",
    "quantize_activations_t",
    "quantize_weight_blockwise",
    "quantize_weight_checked",
    "saturating_cast",
]
