"""Isolate the K = 256 disagreement of tests/test_fp8_training.py::test_pallas_path_matches_reference on
the GPU (3.7e-2 in float32, with the Mosaic GEMM in session 3 and with the Triton GEMM in session 4):
the exact input, each stage of the forward compared separately (weight quantization kernel vs
reference, activation quantization, the Triton and Mosaic GEMMs on reference-quantized operands,
the full fp8_linear forward), eagerly and under jit."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from fp8rl_jax.quant.fp8 import quantize_activations  # noqa: E402
from fp8rl_jax.quant.policy import Kernels, quantize_weight  # noqa: E402
from fp8rl_jax.quant.training import Fp8TrainRecipe, fp8_linear  # noqa: E402
from pallas_kernels import fp8_gemm as T  # noqa: E402
from pallas_kernels import fp8_gemm_mgpu as G  # noqa: E402


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


rng = np.random.default_rng(16)
for s in ((24, 136), (136, 136), (24, 136)):  # the test's first case consumes these draws
    rng.standard_normal(s)
x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((256, 256), (128, 256)))
qp = quantize_weight(w, (128, 128), Kernels.PALLAS)
qr = quantize_weight(w, (128, 128), Kernels.REFERENCE)
print("weight q equal:", bool(jnp.all(qp.q.astype(jnp.float32) == qr.q.astype(jnp.float32))),
      "scale rel:", rel(qp.scale_inv, qr.scale_inv), "scales", np.asarray(qp.scale_inv), np.asarray(qr.scale_inv))
xq, xs = quantize_activations(x, 128)
xq_cpu, xs_cpu = jax.jit(lambda a: quantize_activations(a, 128), backend="cpu")(jax.device_put(x, jax.devices("cpu")[0]))
print("act q equal GPU vs CPU:", bool(np.all(np.asarray(xq.astype(jnp.float32)) == np.asarray(xq_cpu.astype(jnp.float32)))),
      "act scale rel:", rel(xs, xs_cpu))
ref = T.fp8_gemm_reference(xq, xs, qr.q, qr.scale_inv, out_dtype=jnp.float32)
ref64 = (np.asarray(xq.astype(jnp.float32), np.float64).reshape(256, 2, 128) * np.asarray(xs, np.float64)[:, :, None]
         ).reshape(256, 256) @ (np.asarray(qr.q.astype(jnp.float32), np.float64) *
                                np.repeat(np.repeat(np.asarray(qr.scale_inv, np.float64), 128, 0), 128, 1)).T
print("reference vs float64:", rel(ref, ref64))
for name, fn in (("triton", lambda *a: T.fp8_gemm(*a, out_dtype=jnp.float32, interpret=False)),
                 ("triton_jit", jax.jit(lambda *a: T.fp8_gemm(*a, out_dtype=jnp.float32, interpret=False))),
                 ("mgpu", lambda *a: G.fp8_gemm_mgpu(*a, out_dtype=jnp.float32, config=G.DEFAULT_CONFIG, interpret=False))):
    try:
        out = fn(xq, xs, qr.q, qr.scale_inv)
        err = np.abs(np.asarray(out) - ref64)
        print(f"{name}: rel vs float64 {rel(out, ref64):.2e}; rows off: {int((err.max(1) > 1e-3 * np.abs(ref64).max()).sum())}, "
              f"cols off: {int((err.max(0) > 1e-3 * np.abs(ref64).max()).sum())}", flush=True)
    except Exception as e:
        print(name, "failed:", type(e).__name__, str(e)[:300], flush=True)
for kk in (Kernels.PALLAS, Kernels.REFERENCE):
    y = fp8_linear(x, w, Fp8TrainRecipe(kernels=kk), jnp.float32)
    yj = jax.jit(lambda a, b, kk=kk: fp8_linear(a, b, Fp8TrainRecipe(kernels=kk), jnp.float32))(x, w)
    print(f"fp8_linear {kk.name}: eager rel vs float64 {rel(y, ref64):.2e}, jit {rel(yj, ref64):.2e}", flush=True)
