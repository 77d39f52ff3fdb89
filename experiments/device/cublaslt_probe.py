"""One cuBLASLt block-scaled FP8 GEMM (256 x 4096 x 4096) on the GPU against the jnp reference; exit 1 if it
does not run or is off. Device scripts run it before anything that depends on the cuBLASLt path."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.quant import cublaslt, quantize_activations, quantize_weight_blockwise
from pallas_kernels import fp8_gemm


def main() -> int:
    ok, why = cublaslt.available()
    print("cuBLASLt available:", ok, why, "version", cublaslt.cublaslt_version()[0] if ok else None, flush=True)
    if not ok:
        return 1
    ka, kb = jax.random.split(jax.random.key(0))
    x = jax.random.normal(ka, (256, 4096), jnp.bfloat16)
    w = quantize_weight_blockwise(jax.random.normal(kb, (4096, 4096), jnp.float32) * 0.02)
    qa, sa = quantize_activations(x)
    try:
        out = np.asarray(cublaslt.fp8_gemm_cublaslt(qa, sa, w.q, w.scale_inv, out_dtype=jnp.float32))
    except Exception as e:  # noqa: BLE001 - report and fall back
        print("cuBLASLt GEMM failed:", type(e).__name__, str(e)[:500], flush=True)
        return 1
    ref = np.asarray(fp8_gemm.fp8_gemm_reference(qa, sa, w.q, w.scale_inv, out_dtype=jnp.float32))
    err = float(np.abs(out - ref).max() / np.abs(ref).max())
    print(f"cuBLASLt GEMM vs reference: max rel err {err:.2e}", flush=True)
    return 0 if err < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
