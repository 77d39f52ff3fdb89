"""GPU time of the grouped FP8 GEMM alone (session 13): the sweep's wall clock per call (0.15-0.24 ms for
every config at 64-256 tokens, ~1.3 TB/s of expert weights) may hold launch gaps of the work-item and scale
ops around the kernel; `replay_gpu_ms` sums the kernels' own GPU time per call, by name.

    python experiments/device/gg_gpu_time.py --out $OUT/gg_gpu_time.json
"""

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp

from fp8rl_jax.quant import fp8 as fp8_ref
from pallas_kernels import fp8_grouped_gemm as gg
from pallas_kernels.common import replay_gpu_ms, run_environment

C = gg.GroupedGemmConfig
CONFIGS = (  # session 13 call 3: scales preloaded before the K loop (the default now) against loaded in it
    C(16, 128, 4, 4, swap_ab=True), C(16, 128, 4, 4, swap_ab=True, preload_scales=False),
    C(16, 64, 4, 4, swap_ab=True), C(16, 64, 4, 4, swap_ab=True, preload_scales=False),
    C(64, 128, 4, 3), C(64, 128, 4, 3, preload_scales=False),
)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="*", default=[256, 64])
    p.add_argument("--budget-s", type=float, default=100)
    args = p.parse_args()
    t0 = time.perf_counter()
    key = jax.random.key(0)
    out = {**run_environment(), "measure": "replay_gpu_ms: kernels' GPU time per call (busy), span, top kernels",
           "rows": []}
    for tokens in args.tokens:
        m = tokens * gg.BENCH_TOP_K
        gs = gg.route(jax.random.fold_in(key, tokens), tokens, "uniform", gg.BENCH_E, gg.BENCH_TOP_K)
        for name in ("gate_up", "down"):
            n, k = gg.BENCH_SHAPES[name]
            w = jax.random.normal(jax.random.fold_in(key, n), (gg.BENCH_E, n, k), jnp.bfloat16) * 0.05
            qw = fp8_ref.quantize_weight_blockwise(w)
            sets = [(*fp8_ref.quantize_activations(
                jax.random.normal(jax.random.fold_in(key, r), (m, k), jnp.bfloat16)), qw.q, qw.scale_inv, gs)
                for r in range(4)]
            wbytes = gg.BENCH_E * n * k
            for cfg in CONFIGS:
                if time.perf_counter() - t0 > args.budget_s:
                    print("budget: stop", flush=True)
                    json.dump(out, open(args.out, "w"), indent=1)
                    return
                try:
                    r = replay_gpu_ms(lambda qa, sa, q, s, g, cfg=cfg: gg.fp8_grouped_gemm(
                        qa, sa, q, s, g, config=cfg, interpret=False), sets)
                except Exception as ex:  # report and go on
                    r = {"error": f"{type(ex).__name__}: {str(ex)[:200]}"}
                kern = {kk: v for kk, v in r.get("kernels", {}).items() if "grouped" in kk}
                kus = sum(kern.values())
                row = {"shape": name, "tokens": tokens, "config": dataclasses.asdict(cfg), **r,
                       "grouped_kernel_us": kus, "weight_tb_s": wbytes / (kus * 1e-6) / 1e12 if kus else None}
                out["rows"].append(row)
                print(f"{name} tokens={tokens} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                      f"{' swap' if cfg.swap_ab else ''}{'' if cfg.preload_scales else ' scales-in-loop'}: busy {r.get('busy_ms', float('nan')) * 1e3:.1f} us, "
                      f"span {r.get('span_ms', float('nan')) * 1e3:.1f} us, kernel {kus:.1f} us "
                      f"({row['weight_tb_s'] or 0:.2f} TB/s of weights) {r.get('error', '')}", flush=True)
                json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
