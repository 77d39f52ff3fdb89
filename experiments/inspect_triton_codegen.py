"""Offline codegen inspection of Pallas (Triton) kernels for sm_90 (no GPU): the paged-attention decode
kernel (default) or, with ``--kernel grouped_gemm``, the FP8 MoE grouped GEMM at a Qwen3-30B-A3B expert
shape (``--gg-configs block_m,block_n,warps,stages[,swap]``; whether the K loop runs wgmma or mma.sync), or with
``--kernel gemm`` the dense FP8 GEMM's split-K decode configs
(``--gemm-configs bm,bn,warps,stages,k_splits[,swap][,preload][,prefetch]``; each result also gives the grid's
programs and its waves of resident CTAs on the 132 SMs of an H100/H200 SXM).

Two halves, run by two interpreters (jax's XLA bundles its own Triton; the `triton` wheel is only
needed for the offline compile):

1. ``dump`` (project venv, jax): lowers `_paged_attention` for CUDA on a CPU-only host
   (``.trace(...).lower(lowering_platforms=("cuda",))``), with the Pallas Triton lowering's GPU
   query patched to sm_90 (Hopper), and captures the Triton MLIR (TTIR) module that jax would put
   into the ``__gpu$xla.gpu.triton`` custom call (the module `lower_jaxpr_to_triton_module` returns;
   the custom call carries its bytecode in the ``ir`` backend-config field).
2. ``compile`` (a venv with ``triton==3.6.0``): runs Triton's NVIDIA stages by hand
   (make_ttir -> make_ttgir -> make_llir -> make_ptx; no driver needed with an explicit
   ``GPUTarget("cuda", 90, 32)``), then the wheel's bundled ``ptxas -v --gpu-name=sm_90a``, and
   prints per variant: registers/spills/shared memory, CTAs per SM, and the loop body's memory,
   barrier and MMA instructions. (``triton.compile(path)`` would skip the TTIR passes for an IR
   input, so the stages are called directly.) XLA's Triton pipeline differs slightly from 3.6's.

    python experiments/inspect_triton_codegen.py --triton-python .scratch/venv/bin/python \\
        [--out .scratch/codegen] [--dtypes bfloat16 float8_e4m3fn] [--bp 4 8] [--stages 2 3] \\
        [--dot-dtypes bfloat16 float16] [--word-gather] [--warps 4]

Files: ``OUT/<dtype>[_<dot dtype>]_bp<b>_w<w>_s<s>[_kh<k>].{ttir,ttgir,llir,ptx}`` (the dot dtype,
``fp8_dot_dtype``, named for FP8 pools only; other pools ignore it). The loop's SASS, by instruction kind, comes
from the triton wheel's ``cuobjdump -sass`` on the ``.cubin``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOPPER_SMS = 132  # SMs of an H100 / H200 SXM


def dump(captured: list[str], out: Path, dtypes, bps, stages, warps, batch: int, context: int,
         dot_dtypes=("bfloat16",), word_gather: bool = False, kv_heads=(1,)) -> list[dict]:
    """TTIR of `_paged_attention` per config (``captured``: the list `triton_ir_for_sm90` fills)."""
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels import paged_attention as pa

    S = jax.ShapeDtypeStruct
    P = batch * (context // 16 + 1)  # the pool size only changes nothing but the bound of the id clamp
    jobs = []
    for dt in dtypes:
        fp8 = jnp.dtype(dt) == jnp.float8_e4m3fn
        for bp, st, w, ddt, kh in itertools.product(bps, stages, warps, dot_dtypes if fp8 else dot_dtypes[:1],
                                                    kv_heads):
            captured.clear()
            cfg = pa.PagedAttentionConfig(pages_per_block=bp, pages_per_split=64, num_warps=w, num_stages=st,
                                          fp8_dot_dtype=ddt, fp8_word_gather=word_gather, kv_heads_per_program=kh)
            args = (S((batch, 32, 128), jnp.bfloat16), S((P, 16, 8, 128), jnp.dtype(dt)),
                    S((P, 16, 8, 128), jnp.dtype(dt)), S((), jnp.float32), S((), jnp.float32),
                    S((batch, context // 16 + 1), jnp.int32), S((batch,), jnp.int32))
            fn = jax.jit(functools.partial(pa._paged_attention, config=cfg, interpret=False))
            fn.trace(*args).lower(lowering_platforms=("cuda",))
            assert len(captured) == 1, len(captured)
            words = "_words" if fp8 and word_gather and ddt == "float16" else ""
            name = f"{dt}_{ddt}{words}_bp{bp}_w{w}_s{st}" if fp8 else f"{dt}_bp{bp}_w{w}_s{st}"
            name += f"_kh{kh}" if kh > 1 else ""
            (out / f"{name}.ttir").write_text(captured[0])
            jobs.append({"name": name, "num_warps": w, "num_stages": st})
    return jobs


def dump_grouped_gemm(captured: list[str], out: Path, configs: list[str], tokens: int, n: int, k: int) -> list[dict]:
    """TTIR of `fp8_grouped_gemm` per config ``bm,bn,warps,stages[,swap]`` at M = tokens * 8, 128
    experts, [N, K] expert weights (``captured``: the list `triton_ir_for_sm90` fills)."""
    import jax
    import jax.numpy as jnp

    from experiments.bench.suites.grouped_gemm import BENCH_E, BENCH_TOP_K
    from pallas_kernels import fp8_grouped_gemm as gg

    S = jax.ShapeDtypeStruct
    m, e, kb = tokens * BENCH_TOP_K, BENCH_E, -(-k // 128)
    args = (S((m, k), jnp.float8_e4m3fn), S((m, kb), jnp.float32), S((e, n, k), jnp.float8_e4m3fn),
            S((e, -(-n // 128), kb), jnp.float32), S((e,), jnp.int32))
    jobs = []
    for spec in configs:
        f = spec.split(",")
        bm, bn, w, st = (int(x) for x in f[:4])
        swap = len(f) > 4 and f[4] in ("swap", "1", "true")
        cfg = gg.GroupedGemmConfig(bm, bn, w, st, swap_ab=swap)
        captured.clear()
        gg._fp8_grouped_gemm.trace(*args, jnp.dtype(jnp.bfloat16), cfg, False).lower(lowering_platforms=("cuda",))
        assert len(captured) == 1, len(captured)
        name = f"gg_n{n}_k{k}_bm{bm}_bn{bn}_w{w}_s{st}{'_swap' if swap else ''}"
        (out / f"{name}.ttir").write_text(captured[0])
        jobs.append({"name": name, "num_warps": w, "num_stages": st})
    return jobs


def dump_gemm(captured: list[str], out: Path, configs: list[str], m: int, n: int, k: int) -> list[dict]:
    """TTIR of the dense `fp8_gemm` (Triton) per config ``block_m,block_n,warps,stages,k_splits`` at [M, K] x [N, K]^T
    (``captured``: the list `triton_ir_for_sm90` fills): whether its decode configs' K loop runs wgmma."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import fp8_gemm as fg

    S = jax.ShapeDtypeStruct
    kb = -(-k // 128)
    args = (S((m, k), jnp.float8_e4m3fn), S((m, kb), jnp.float32), S((n, k), jnp.float8_e4m3fn),
            S((-(-n // 128), kb), jnp.float32))
    jobs = []
    for spec in configs:
        cfg = fg.GemmConfig.from_spec(spec)
        bm, bn, w, st, ks = cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.k_splits
        swap, preload, prefetch = cfg.swap_ab, cfg.preload_scales, cfg.prefetch_scales
        captured.clear()
        fg._fp8_gemm.trace(*args, jnp.dtype(jnp.bfloat16), cfg, False).lower(lowering_platforms=("cuda",))
        assert len(captured) == 1, len(captured)
        name = (f"gemm_m{m}_n{n}_k{k}_bm{bm}_bn{bn}_w{w}_s{st}_k{ks}{'_swap' if swap else ''}"
                f"{'_preload' if preload else ''}{'_prefetch' if prefetch else ''}")
        (out / f"{name}.ttir").write_text(captured[0])
        jobs.append({"name": name, "num_warps": w, "num_stages": st, "programs": fg.grid_programs(m, n, k, cfg)})
    return jobs


def _loop_body(ptx: str) -> str:
    """The PTX between the label of the innermost backward branch's target and that branch (the
    block loop; the kernel has one loop)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\$L__\w+):", l))}
    best = None
    for i, l in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__\w+);", l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            if best is None or i - labels[m.group(1)] > best[1] - best[0]:
                best = (labels[m.group(1)], i)
    return "\n".join(lines[best[0]:best[1] + 1]) if best else ""


_OPS = ("ld.global", "cp.async.cg", "cp.async.ca", "cp.async.commit_group", "cp.async.wait_group", "ld.shared",
        "st.shared", "ldmatrix", "stmatrix", "mma.sync", "wgmma.mma_async", "bar.sync", "shfl.sync", "cvt.rn.f16x2.e4m3x2",
        "cvt.bf16.f16", "ex2.approx")


def _op_counts(body: str) -> dict:
    ops = {}
    for l in body.splitlines():
        l = re.sub(r"^\s*(@!?%p\d+\s+)?", "", l)
        for op in _OPS:
            if l.startswith(op):
                m = re.match(r"([\w.]+)", l)
                key = m.group(1)
                ops[key] = ops.get(key, 0) + 1
    waits = re.findall(r"cp\.async\.wait_group\s+(\d+)", body)
    if waits:
        ops["cp.async.wait_group N"] = ",".join(waits)
    return dict(sorted(ops.items()))


def _sass_loop(sass: str) -> dict:
    """The innermost-loop facts of ``cuobjdump -sass`` text: its instruction count (the longest
    backward branch's body, one warp's instructions per iteration) and the count of each opcode."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for i, (addr, text) in enumerate(ins):
        t = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if t and int(t.group(1), 16) < addr:
            j = next((k for k, (a, _) in enumerate(ins) if a == int(t.group(1), 16)), None)
            if j is not None and (best is None or i - j > best[1] - best[0]):
                best = (j, i)
    if best is None:
        return {}
    ops: dict = {}
    for _, text in ins[best[0]:best[1] + 1]:
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    return {"instructions": best[1] - best[0] + 1, "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def _ttgir_loop_facts(ttgir: str) -> dict:
    lines = ttgir.splitlines()
    i0 = next(i for i, l in enumerate(lines) if "scf.for" in l)
    indent = len(lines[i0]) - len(lines[i0].lstrip())
    i1 = next(i for i in range(i0 + 1, len(lines)) if lines[i].startswith(" " * indent + "}"))
    body = "\n".join(lines[i0:i1 + 1])
    return {
        "smem_buffers": re.findall(r"ttg.local_alloc : \(\) -> !ttg.memdesc<([0-9x]+)", ttgir),
        "async_copies_in_loop": body.count("ttg.async_copy_global_to_local"),
        "async_wait_num": re.findall(r"ttg.async_wait.*\{num = (\d+)", body),
        "reg_tt_load_tensors_in_loop": len(re.findall(r"tt.load %\w+, %\w+, %\w+ : tensor<\d+x\d+x\d+", body))
        + len(re.findall(r"tt.load %\w+, %\w+, %\w+ : tensor<\d+x\d+x!", body)),
        "local_alloc_from_regs_in_loop": len(re.findall(r"ttg.local_alloc %", body)),
        "local_load_in_loop": body.count("ttg.local_load"),
        "convert_layout_in_loop": body.count("ttg.convert_layout"),
        "dot": sorted(set(re.findall(r"(tt\.dot|ttng\.warp_group_dot)\b", body))),
        "mma_version": re.findall(r"nvidia_mma<\{versionMajor = (\d)", ttgir)[:1],
    }


def compile_all(out: Path, jobs: list[dict]) -> list[dict]:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend, get_ptxas
    from triton.compiler.compiler import IRSource

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    ptxas = get_ptxas(target.arch).path
    results = []
    for job in jobs:
        name = job["name"]
        ctx = ir.context()
        src = IRSource(str(out / f"{name}.ttir"), ctx, backend)
        opts = backend.parse_options(dict(num_warps=job["num_warps"], num_stages=job["num_stages"]))
        stages: dict = {}
        backend.add_stages(stages, opts, src.language)
        md = {"target": target, **opts.__dict__}
        mod = src.make_ir(target, opts, None, None, ctx)
        texts = {}
        for st in ("ttir", "ttgir", "llir", "ptx"):
            mod = stages[st](mod, md)
            texts[st] = mod if isinstance(mod, str) else str(mod)
            (out / f"{name}.{st}.txt").write_text(texts[st])
        ptx_path = out / f"{name}.ptx"
        ptx_path.write_text(texts["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(ptx_path), "-o", str(out / f"{name}.cubin")],
                           capture_output=True, text=True)
        log = r.stdout + r.stderr
        regs = int(re.search(r"Used (\d+) registers", log).group(1))
        cuobjdump = Path(ptxas).with_name("cuobjdump")
        sass = {}
        if cuobjdump.exists():  # the triton wheel ships it beside ptxas
            sass = _sass_loop(subprocess.run([str(cuobjdump), "-sass", str(out / f"{name}.cubin")],
                                             capture_output=True, text=True).stdout)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        smem = md.get("shared", 0)
        warps = job["num_warps"]
        regs_per_warp = -(-regs * 32 // 256) * 256
        cta_by_regs = (65536 // regs_per_warp) // warps
        cta_by_smem = (228 * 1024) // (smem + 1024) if smem else 32
        res = {**job, "registers": regs, "spill_stores": int(spill.group(1)), "spill_loads": int(spill.group(2)),
               "shared_bytes": smem, "ctas_per_sm": min(cta_by_regs, cta_by_smem, 32, 64 // warps),
               "ctas_by_regs": cta_by_regs, "ctas_by_smem": cta_by_smem,
               "loop_ptx_ops": _op_counts(_loop_body(texts["ptx"])), "ttgir_loop": _ttgir_loop_facts(texts["ttgir"]),
               "loop_sass_per_warp": sass.get("instructions"), "loop_sass_ops": sass.get("ops")}
        # the GEMM's grid in waves of resident CTAs on a Hopper GPU's SMs (a partial last wave idles SMs)
        if "programs" in job:
            res["waves"] = round(job["programs"] / (HOPPER_SMS * res["ctas_per_sm"]), 2)
        results.append(res)
        print(json.dumps(res), flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=("all", "dump", "compile"), default="all")
    p.add_argument("--triton-python", default=str(REPO / ".scratch/venv/bin/python"),
                   help="interpreter with triton==3.6.0 for the compile phase")
    p.add_argument("--out", default=str(REPO / ".scratch/codegen"))
    p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float8_e4m3fn"])
    p.add_argument("--bp", type=int, nargs="*", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="*", default=[2, 3])
    p.add_argument("--warps", type=int, nargs="*", default=[4])
    p.add_argument("--dot-dtypes", nargs="*", default=["bfloat16"], choices=("bfloat16", "float16"),
                   help="fp8_dot_dtype of the configs (FP8 pools only)")
    p.add_argument("--word-gather", action="store_true",
                   help="fp8_word_gather=True (FP8 pools with float16 dots: uint32 words split into byte planes)")
    p.add_argument("--kv-heads", type=int, nargs="*", default=[1], help="kv_heads_per_program of the configs")
    p.add_argument("--kernel", choices=("paged_attention", "grouped_gemm", "gemm"), default="paged_attention")
    p.add_argument("--gemm-configs", nargs="*", default=["64,64,4,4,2", "128,64,4,4,4", "128,128,8,4,4"],
                   help="gemm: block_m,block_n,num_warps,num_stages,k_splits[,swap][,preload][,prefetch] per config "
                        "(fp8_gemm.GemmConfig: swap_ab, preload_scales, prefetch_scales)")
    p.add_argument("--gemm-shape", type=int, nargs=3, default=[128, 4096, 4096], metavar=("M", "N", "K"))
    p.add_argument("--gg-configs", nargs="*", default=["16,64,4,4", "64,128,4,3", "16,64,4,4,swap", "16,128,4,4,swap"],
                   help="grouped_gemm: block_m,block_n,num_warps,num_stages[,swap] per config")
    p.add_argument("--gg-shape", type=int, nargs=3, default=[256, 768, 2048], metavar=("TOKENS", "N", "K"),
                   help="grouped_gemm: tokens (M = 8 x tokens), expert N, K")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.phase in ("all", "dump"):
        from pallas_kernels.common import triton_ir_for_sm90

        with triton_ir_for_sm90() as captured:
            if a.kernel == "grouped_gemm":
                jobs = dump_grouped_gemm(captured, out, a.gg_configs, *a.gg_shape)
            elif a.kernel == "gemm":
                jobs = dump_gemm(captured, out, a.gemm_configs, *a.gemm_shape)
            else:
                jobs = dump(captured, out, a.dtypes, a.bp, a.stages, a.warps, a.batch, a.context, a.dot_dtypes,
                            a.word_gather, a.kv_heads)
        (out / "jobs.json").write_text(json.dumps(jobs))
    if a.phase == "all":
        env = dict(os.environ, PYTHONPATH="")
        return subprocess.run([a.triton_python, __file__, "--phase", "compile", "--out", str(out)], env=env).returncode
    if a.phase == "compile":
        compile_all(out, json.loads((out / "jobs.json").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
