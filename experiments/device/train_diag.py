"""Where the FP8 training linear's Pallas path departs from its reference natively (session 3 diagnostic)."""
import sys, jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from fp8rl_jax.quant.fp8 import quantize_activations
from fp8rl_jax.quant.policy import quantize_weight, Kernels
from fp8rl_jax.quant import training as T
from pallas_kernels.fp8_gemm import fp8_gemm_reference
rng = np.random.default_rng(16)
for m, k, n in ((24, 136, 136), (256, 256, 128)):
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((m, k), (n, k)))
    for dt in (jnp.float32, jnp.bfloat16):
        qp = quantize_weight(w.astype(dt), (128, 128), Kernels.PALLAS)
        qr = quantize_weight(w.astype(dt), (128, 128), Kernels.REFERENCE)
        same_q = bool(jnp.all(qp.q.astype(jnp.float32) == qr.q.astype(jnp.float32)))
        same_s = float(jnp.max(jnp.abs(qp.scale_inv - qr.scale_inv)))
        xq, xs = quantize_activations(x.astype(dt), 128)
        ref = np.asarray(fp8_gemm_reference(xq, xs, qr.q, qr.scale_inv, out_dtype=jnp.float32))
        y = np.asarray(T._block_gemm(xq, xs, qp.q, qp.scale_inv, dt), np.float32)
        yl = np.asarray(T.fp8_linear(x, w, T.Fp8TrainRecipe(kernels=Kernels.PALLAS), dt), np.float32)
        yr = np.asarray(T.fp8_linear(x, w, T.Fp8TrainRecipe(kernels=Kernels.REFERENCE), dt), np.float32)
        e = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
        print(f"{m}x{k}x{n} {jnp.dtype(dt).name}: codes equal {same_q}, scale diff {same_s:.2e}, gemm vs ref {e(y, ref):.2e}, "
              f"linear pallas vs ref {e(yl, yr):.2e}, linear ref vs gemm ref {e(yr, ref):.2e}", flush=True)
