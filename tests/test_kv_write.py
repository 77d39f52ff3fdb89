"""Decode-step KV write kernel: interpret mode on the CPU and natively on the GPU (twin classes),
bitwise against the scatter it replaces, on fresh random inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_write as kw

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32


def _case(seed, pool_dtype, *, P=9, ps=4, K=2, H=16, B=6):
    rng = np.random.default_rng(seed)
    pools = [jnp.asarray(rng.standard_normal((P, ps, K, H)) * 3, F32).astype(pool_dtype) for _ in range(2)]
    k = jnp.asarray(rng.standard_normal((B, K, H)) * 200, jnp.bfloat16)  # some saturate at FP8's 448
    v = jnp.asarray(rng.standard_normal((B, K, H)), jnp.bfloat16)
    # distinct (page, slot) targets, plus rows that must not write: -1, P, a huge id
    targets = rng.choice(P * ps, B, replace=False)
    page, slot = (targets // ps).astype(np.int32), (targets % ps).astype(np.int32)
    page[[1, 3]] = [-1, P]
    if B > 4:
        page[4] = 2**30
    scales = (jnp.float32(rng.uniform(0.01, 0.5)), jnp.float32(rng.uniform(0.01, 0.5)))
    return (k, v, *pools, jnp.asarray(page), jnp.asarray(slot), *scales)


class TestKvWriteInterpret:
    INTERPRET = True

    @pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, FP8, F32])
    def test_bitwise_reference(self, pool_dtype):
        args = _case(int(np.random.default_rng().integers(1 << 30)), pool_dtype)
        before = [np.asarray(x.astype(F32)) for x in args[2:4]]
        want = kw.kv_write_reference(*args)
        got = kw.kv_write(*args, interpret=self.INTERPRET)
        for g, w, b in zip(got, want, before, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(w.astype(F32)))
            changed = np.any(np.asarray(g.astype(F32)) != b, axis=(2, 3))
            assert changed.sum() <= 3  # only the three rows with an in-range page wrote
        if pool_dtype == FP8:  # saturated, never NaN/Inf
            assert np.isfinite(np.asarray(got[0].astype(F32))).all()
            assert np.abs(np.asarray(got[0].astype(F32))).max() == 448.0

    def test_validation(self):
        k, v, kp, vp, page, slot, ks, vs = _case(0, jnp.bfloat16)
        with pytest.raises(ValueError, match="powers of two"):
            kw.kv_write(k[:, :, :12], v[:, :, :12], kp[..., :12], vp[..., :12], page, slot, ks, vs)
        with pytest.raises(ValueError, match="int32"):
            kw.kv_write(k, v, kp, vp, page.astype(jnp.int16), slot, ks, vs)
        with pytest.raises(ValueError, match="per token"):
            kw.kv_write(k, v, kp[:, :, :1], vp[:, :, :1], page, slot, ks, vs)


@pytest.mark.gpu
class TestKvWriteGpu(TestKvWriteInterpret):
    INTERPRET = False
