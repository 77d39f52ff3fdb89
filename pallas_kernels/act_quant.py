"""SwiGLU and FP8 activation quantization in one pass (Pallas, Triton lowering): the down projection's input.

What: ``gu [M, 2I]`` bf16, the fused gate/up GEMM's output ``[g | u]`` -> ``x = silu(g) * u`` quantized per token
in 1 x 128 groups: ``q float8_e4m3fn [M, I]`` and float32 scales, ``[I/128, M]`` (``scales_t``, the order cuBLASLt
reads) or ``[M, I/128]``. `silu_mul_quant_reference` is the jnp twin: ``quantize_activations_t(jax.nn.silu(g) *
u)``, what the model computed before this kernel.

Why: XLA ran that as three kernels per layer (the group maxima of ``silu(g) * u``, recomputing it; the scales; the
codes, recomputing it again): reading the [256, 24576] bf16 GEMM output twice. On the H200 in Qwen3-8B's decode
step (mode all, 256 rows, session 20) the three took 188 + 184 + 58 us per step of 15.9 ms. This kernel reads
``gu`` once and writes the codes and scales once.

Math, as the reference computes it in bf16 (XLA's HLO for ``jax.nn.silu`` of bf16, checked in the H200 profile):
``s = bf16(1 / f32(bf16(bf16(exp(-g)) + 1)))``, ``x = bf16(bf16(g * s) * u)``; then `quantize_activations`'s
rules: ``amax`` per group in float32, ``scale = amax / 448`` (IEEE division) floored at the smallest normal
float32, 1.0 for an all-zero group, ``q = cast_rne(clip(x * (1 / scale), -448, 448))``. The divisions are IEEE
``div.rn.f32`` on the GPU (`pallas_kernels.fp8_quant`'s design note says why). The exponential is the GPU's own,
and XLA:GPU's reference has its own: where they differ next to a bf16 rounding boundary an element of ``x`` rounds
to the neighbouring bf16 value, and its code can move one E4M3 step (on the H200, session 20: 0.08-0.16% of the
codes, and no less accurate against float64 than XLA's). On the CPU (interpret mode) the result is the
reference's bit for bit. `tests/test_act_quant.py` checks both.

Tiling: one program per ``block_m`` rows x ``groups`` quantization groups, the gate and up tiles read through two
BlockSpecs of the same array. ``M`` a multiple of ``block_m`` (a power of two dividing M is chosen), ``I`` a
multiple of 128.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.quant.fp8 import E4M3_MAX, quantize_activations, quantize_activations_t
from pallas_kernels.common import resolve_interpret
from pallas_kernels.fp8_quant import _ieee_div

GROUP = 128
_F32_TINY = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class ActQuantConfig:
    """Tiling: ``block_m`` rows (at most; the largest power of two <= it that divides M) and ``groups``
    quantization groups (at most; the largest that divides I / 128) per program."""

    block_m: int = 16
    groups: int = 2
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_m", "groups", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0 or v & (v - 1):
                raise ValueError(f"ActQuantConfig.{name} must be a positive power of two, got {v!r}")


DEFAULT_CONFIG = ActQuantConfig()


def supports(gu_shape: tuple[int, ...]) -> bool:
    """Whether the kernel takes ``gu`` of this shape: ``[M, 2I]``, ``I`` a multiple of 128, ``M >= 1``."""
    return len(gu_shape) == 2 and gu_shape[0] >= 1 and gu_shape[1] % (2 * GROUP) == 0


def _bf16(x: jax.Array) -> jax.Array:
    """Rounded to bfloat16 and back: what XLA does after every bf16 op."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _kernel(g_ref, u_ref, q_ref, s_ref, *, groups: int, native: bool, scales_t: bool):
    bm = g_ref.shape[0]
    for j in range(groups):
        cols = pl.ds(j * GROUP, GROUP)
        g = g_ref[:, cols].astype(jnp.float32)
        u = u_ref[:, cols].astype(jnp.float32)
        den = _bf16(_bf16(jnp.exp(-g)) + 1.0)
        sig = _bf16(_ieee_div(jnp.ones_like(den), den, native))
        x = _bf16(_bf16(g * sig) * u)
        amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)  # [bm, 1]
        scale = _ieee_div(amax, jnp.full(amax.shape, E4M3_MAX, jnp.float32), native)
        scale = jnp.maximum(scale, jnp.float32(_F32_TINY))
        scale = jnp.where(amax == 0, jnp.float32(1.0), scale)
        inv = _ieee_div(jnp.ones_like(scale), scale, native)
        q_ref[:, cols] = jnp.clip(x * inv, -E4M3_MAX, E4M3_MAX).astype(q_ref.dtype)
        if scales_t:
            s_ref[pl.ds(j, 1), :] = scale.reshape(1, bm)
        else:
            s_ref[:, pl.ds(j, 1)] = scale


def _pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


@functools.partial(jax.jit, static_argnames=("scales_t", "config", "interpret"))
def _call(gu: jax.Array, scales_t: bool, config: ActQuantConfig, interpret: bool):
    m, two_i = gu.shape
    i = two_i // 2
    bm = _pow2_divisor(m, config.block_m)
    gb = _pow2_divisor(i // GROUP, config.groups)
    bw = gb * GROUP
    half = i // bw
    kernel = functools.partial(_kernel, groups=gb, native=not interpret, scales_t=scales_t)
    if scales_t:
        s_spec = pl.BlockSpec((gb, bm), lambda r, c: (c, r))
        s_shape = jax.ShapeDtypeStruct((i // GROUP, m), jnp.float32)
    else:
        s_spec = pl.BlockSpec((bm, gb), lambda r, c: (r, c))
        s_shape = jax.ShapeDtypeStruct((m, i // GROUP), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(m // bm, half),
        in_specs=[pl.BlockSpec((bm, bw), lambda r, c: (r, c)), pl.BlockSpec((bm, bw), lambda r, c: (r, c + half))],
        out_specs=[pl.BlockSpec((bm, bw), lambda r, c: (r, c)), s_spec],
        out_shape=[jax.ShapeDtypeStruct((m, i), jnp.float8_e4m3fn), s_shape],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="silu_mul_quant",
    )(gu, gu)


def silu_mul_quant(gu: jax.Array, *, scales_t: bool = True, config: ActQuantConfig | None = None,
                   interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """``quantize_activations_t(silu(g) * u)`` (``scales_t``; else `quantize_activations`'s ``[M, I/128]``
    scales) of ``gu = [g | u]`` ``[M, 2I]`` bfloat16, in one kernel (module note)."""
    config = DEFAULT_CONFIG if config is None else config
    if not hasattr(gu, "dtype") or jnp.dtype(gu.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"silu_mul_quant takes bfloat16 [M, 2I], got {getattr(gu, 'dtype', type(gu))}")
    if not supports(tuple(gu.shape)):
        raise ValueError(f"silu_mul_quant takes [M, 2I] with I a multiple of {GROUP}, got shape {tuple(gu.shape)}")
    return _call(gu, scales_t, config, resolve_interpret(interpret))


def silu_mul_quant_reference(gu: jax.Array, *, scales_t: bool = True) -> tuple[jax.Array, jax.Array]:
    """The jnp twin: ``g, u = split(gu)``; ``x = jax.nn.silu(g) * u`` in ``gu``'s dtype; its per-token 1x128
    quantization (`quantize_activations_t` / `quantize_activations`)."""
    g, u = jnp.split(gu, 2, axis=-1)
    x = jax.nn.silu(g) * u
    return quantize_activations_t(x) if scales_t else quantize_activations(x)


def main(argv: list[str] | None = None) -> int:
    """GPU time of the kernel against its jnp twin (XLA's fusions) per M at width ``--i``: ``python -m
    pallas_kernels.act_quant --m 256 4096 --out r.json``. Bytes moved: gu read once, codes and scales written."""
    import argparse

    from pallas_kernels.common import replay_gpu_ms, write_results

    p = argparse.ArgumentParser(description="time silu_mul_quant against its reference")
    p.add_argument("--m", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--i", type=int, default=12288)
    p.add_argument("--sets", type=int, default=6)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for m in args.m:
        sets = [(_gu_random(m, args.i, seed),) for seed in range(args.sets)]
        moved = m * 2 * args.i * 2 + m * args.i + 4 * m * args.i // GROUP
        for name, fn in (("kernel", lambda gu: silu_mul_quant(gu, interpret=False)),
                         ("reference", silu_mul_quant_reference)):
            res = replay_gpu_ms(fn, sets)
            rows.append({"m": m, "i": args.i, "impl": name, "gpu_us": res["busy_ms"] * 1e3,
                         "gbps": moved / res["busy_ms"] / 1e6, "kernels": res["kernels"]})
            print(f"M={m:5d} I={args.i} {name:9s} {res['busy_ms'] * 1e3:8.2f} us {rows[-1]['gbps']:7.0f} GB/s "
                  f"{list(res['kernels'])}", flush=True)
    if args.out:
        write_results(args.out, rows)
    return 0


def _gu_random(m: int, i: int, seed: int) -> jax.Array:
    return (jax.random.normal(jax.random.key(seed), (m, 2 * i), jnp.float32) * 3).astype(jnp.bfloat16)


if __name__ == "__main__":
    raise SystemExit(main())
