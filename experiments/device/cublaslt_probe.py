"""cuBLASLt's block-scaled FP8 GEMM on the GPU before anything depends on it: one 256 x 4096 x 4096 product
against the jnp reference through each registration (graph-capturable and eager), and 64 chained products in
one jitted loop through each, timed. The loop body (quantize + GEMM) is probably below XLA's minimum
command-buffer size (5 ops by default), so the timing checks the call rather than graph capture.
Exit 0: the capturable registration works; 3: only the eager one (run with FP8RL_CUBLASLT_GRAPHS=0); 1: neither."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.quant import cublaslt, quantize_activations, quantize_weight_blockwise
from pallas_kernels import fp8_gemm


def check(target: str, qa, sa, w) -> bool:
    try:
        out = np.asarray(cublaslt._call(qa, sa, w.q, w.scale_inv, jnp.dtype(jnp.float32), target=target))
        ref = np.asarray(fp8_gemm.fp8_gemm_reference(qa, sa, w.q, w.scale_inv, out_dtype=jnp.float32))
        err = float(np.abs(out - ref).max() / np.abs(ref).max())

        @jax.jit
        def chain(x):
            def body(_, x):
                q, s = quantize_activations(x)
                return cublaslt._call(q, s, w.q, w.scale_inv, jnp.dtype(jnp.bfloat16), target=target)
            return jax.lax.fori_loop(0, 64, body, x)

        x = jnp.asarray(out, jnp.bfloat16) / 64
        jax.block_until_ready(chain(x))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(chain(x))
            ts.append(time.perf_counter() - t0)
        print(f"{target}: max rel err {err:.2e}; 64 chained quantize+GEMM in a jitted loop: "
              f"{1e6 * float(np.median(ts)) / 64:.1f} us each (median of 5)", flush=True)
        return err < 1e-3
    except Exception as e:  # noqa: BLE001 - report and fall back
        print(f"{target} failed: {type(e).__name__}: {str(e)[:600]}", flush=True)
        return False


def main() -> int:
    ok, why = cublaslt.available()
    print("cuBLASLt available:", ok, why, "version", cublaslt.cublaslt_version()[0] if ok else None, flush=True)
    if not ok:
        return 1
    ka, kb = jax.random.split(jax.random.key(0))
    x = jax.random.normal(ka, (256, 4096), jnp.float32)
    w = quantize_weight_blockwise(jax.random.normal(kb, (4096, 4096), jnp.float32) * 0.02)
    qa, sa = quantize_activations(x)
    eager = check(cublaslt.FFI_TARGET_EAGER, qa, sa, w)
    graphs = check(cublaslt.FFI_TARGET, qa, sa, w)
    return 0 if graphs else (3 if eager else 1)


if __name__ == "__main__":
    sys.exit(main())
