"""The unscaled (BF16 / F32) grouped expert GEMM the generator's BF16 MoE runs
(`pallas_kernels.fp8_grouped_gemm.grouped_gemm`): interpret mode on the CPU, natively on the GPU
(twin classes), against ``ragged_dot`` and float64 NumPy on fresh random inputs, and through
``DensePolicy(ragged_kernels=...)`` in a tiny MoE forward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3_moe
from fp8rl_jax.models import DensePolicy, forward, init_params
from fp8rl_jax.models.policy import Kernels
from pallas_kernels import fp8_grouped_gemm as G

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {F32: 1e-5, BF16: 1e-5}  # vs float64 on the same (rounded) operands; float32 accumulation


def _f64(a, b, sizes, m):
    a, b = np.asarray(a.astype(F32), np.float64), np.asarray(b.astype(F32), np.float64)
    out, r = np.zeros((m, b.shape[1])), 0
    for g, s in enumerate(np.maximum(sizes, 0)):
        s = int(min(s, m - r))
        out[r : r + s] = a[r : r + s] @ b[g].T
        r += s
    return out


class TestDenseGroupedInterpret:
    INTERPRET = True
    SHAPES = [(50, 200, 4, 96, G.GroupedGemmConfig(16, 32, 4, 2)),  # ragged K, N; tail rows
              (64, 256, 8, 128, G.GroupedGemmConfig(32, 64, 4, 2)),
              (50, 200, 4, 96, G.GroupedGemmConfig(16, 32, 4, 2, swap_ab=True))]  # tiles computed transposed

    @pytest.mark.parametrize("dtype,case", [(F32, 0), (BF16, 1), (BF16, 2)])
    def test_matches_ragged_dot_and_float64(self, dtype, case):
        m, k, e, n, cfg = self.SHAPES[case]
        rng = np.random.default_rng()
        a = jnp.asarray(rng.standard_normal((m, k)), dtype)
        b = jnp.asarray(rng.standard_normal((e, n, k)), dtype)
        sizes = rng.multinomial(m - 6, np.ones(e) / e)  # 6 tail rows past the groups
        sizes[rng.integers(e)] = 0  # an empty group
        sizes[0] += m - 6 - sizes.sum()
        gs = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(G.grouped_gemm(a, b, gs, out_dtype=F32, config=cfg, interpret=self.INTERPRET))
        want = _f64(a, b, sizes, m)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() / scale < TOL[dtype]
        assert np.all(got[m - 6 :] == 0)
        ref = np.asarray(G.grouped_gemm_reference(a, b, gs, out_dtype=F32))
        assert np.abs(ref - want).max() / scale < TOL[dtype]

    def test_validation(self):
        a, b, gs = jnp.zeros((4, 16), BF16), jnp.zeros((2, 16, 16), F32), jnp.array([2, 2])
        with pytest.raises(ValueError, match="bfloat16 or both float32"):
            G.grouped_gemm(a, b, gs)
        with pytest.raises(ValueError, match="shapes do not fit"):
            G.grouped_gemm(a, b.astype(BF16), jnp.array([4]))


@pytest.mark.gpu
class TestDenseGroupedGpu(TestDenseGroupedInterpret):
    INTERPRET = False


def test_policy_kernel_matches_ragged_dot_in_a_moe_forward():
    """DensePolicy(ragged_kernels=PALLAS) runs the experts through the kernel; the tiny MoE's float32
    logits equal the ragged_dot path's to float32 summation order."""
    cfg = dataclasses.replace(tiny_qwen3_moe, num_layers=2)
    params = init_params(cfg, jax.random.key(3), F32)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    fwd = jax.jit(forward, static_argnames=("config", "policy"))  # one compilation each, not one per op
    ref, _ = fwd(params, tokens, config=cfg, policy=DensePolicy("float32"))
    got, _ = fwd(params, tokens, config=cfg, policy=DensePolicy("float32", ragged_kernels=Kernels.PALLAS))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="ragged_kernels"):
        DensePolicy("float32", ragged_kernels="pallas")
