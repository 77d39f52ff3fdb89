"""Which Mosaic GEMM shapes/configs disagree with the reference natively (session 3 diagnostic)."""
import itertools, sys, jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from fp8rl_jax.quant.fp8 import quantize_activations
from fp8rl_jax.quant.policy import quantize_weight, Kernels
from pallas_kernels import fp8_gemm_mgpu as G
from pallas_kernels.fp8_gemm import fp8_gemm_reference
rows = []
for (m, k, n), cfg, od in itertools.product(
        [(256, 256, 128), (256, 256, 256), (128, 128, 128), (256, 512, 128), (4096, 2048, 2048), (128, 2048, 6144), (4096, 2048, 1024)],
        [None, G.DEFAULT_CONFIG, G.DECODE_CONFIG], [jnp.float32, jnp.bfloat16]):
    c = G.default_config(m, n) if cfg is None else cfg
    if not G.supports(m, n, k, c):
        continue
    x = jax.random.normal(jax.random.key(m + n), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(k), (n, k), jnp.float32)
    xq, xs = quantize_activations(x, 128)
    qw = quantize_weight(w.astype(jnp.bfloat16), (128, 128), Kernels.REFERENCE)
    ref = np.asarray(fp8_gemm_reference(xq, xs, qw.q, qw.scale_inv, out_dtype=jnp.float32))
    out = np.asarray(G.fp8_gemm_mgpu(xq, xs, qw.q, qw.scale_inv, out_dtype=od, config=cfg, interpret=False), np.float32)
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    name = "default" if cfg is None else ("DEFAULT" if cfg == G.DEFAULT_CONFIG else "DECODE")
    print(f"m={m} k={k} n={n} cfg={name}({c.cta_tile_m}x{c.cta_tile_n}) out={jnp.dtype(od).name}: rel err {err:.2e}", flush=True)
