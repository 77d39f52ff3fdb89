"""Smoke tests of the tools kept in experiments/ (the benchmarks' are in test_bench.py): each runs on a tiny
config on the CPU."""

from __future__ import annotations

import dataclasses

from configs.models import tiny_qwen3 as _tiny_qwen3

from conftest import load_experiment as _load

# The tiny preset with one decoder layer: a smoke test's cost on the CPU is XLA compiling its programs, which
# grows with the depth; every layer runs the same code.
tiny_qwen3 = dataclasses.replace(_tiny_qwen3, num_layers=1)


def test_score_demo(tmp_path):
    demo = _load("score_demo")
    summary = demo.main(demo.DemoConfig(model=tiny_qwen3, out=tmp_path))
    assert summary["cli_vs_inprocess_rel_err"] < 1e-5 and summary["logits_shape"][0] == 3


def test_inspect_codegen_counts_the_innermost_loop_of_sass():
    """`inspect_triton_codegen`'s SASS reader: the loop is the longest backward branch's body (a forward
    branch and a shorter loop do not count), its opcodes counted without predicates or modifiers."""
    insp = _load("inspect_triton_codegen")
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R2, 0x1, PT ;
        /*0020*/              @P0 BRA 0x90 ;
        /*0030*/                   LDS R4, [R3] ;
        /*0040*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0050*/              @!P1 FADD R8, R8, R9 ;
        /*0060*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0070*/              @P2 BRA 0x30 ;
        /*0080*/              @P3 BRA 0x60 ;
        /*0090*/                   EXIT ;
    """
    assert insp._sass_loop(sass) == {"instructions": 5, "ops": {"HMMA": 2, "LDS": 1, "FADD": 1, "BRA": 1}}
    assert insp._sass_loop("/*0000*/ EXIT ;") == {}


def test_inspect_codegen_dumps_the_dense_gemm_split_k_configs(tmp_path):
    """``--kernel gemm --phase dump``: the Triton IR of each split-K config of the dense FP8 GEMM, lowered for sm_90
    on the CPU (the compile phase needs the triton wheel and runs elsewhere)."""
    insp = _load("inspect_triton_codegen")
    assert insp.main(["--kernel", "gemm", "--phase", "dump", "--out", str(tmp_path), "--gemm-configs", "64,64,4,4,2",
                      "128,64,4,3,4", "--gemm-shape", "64", "256", "512"]) == 0
    jobs = __import__("json").loads((tmp_path / "jobs.json").read_text())
    names = [j["name"] for j in jobs]
    assert names == ["gemm_m64_n256_k512_bm64_bn64_w4_s4_k2", "gemm_m64_n256_k512_bm128_bn64_w4_s3_k4"]
    assert [j["programs"] for j in jobs] == [1 * 4 * 2, 1 * 4 * 4]  # M tiles x N tiles x K splits (4 K blocks)
    assert all("tt.dot" in (tmp_path / f"{n}.ttir").read_text() for n in names)
    # 5 K blocks asked in 4 splits run 3 splits of 2, 2, 1 blocks (none empty), as the kernel grids them
    assert insp.main(["--kernel", "gemm", "--phase", "dump", "--out", str(tmp_path), "--gemm-configs", "64,64,4,4,4",
                      "--gemm-shape", "64", "256", "640"]) == 0
    assert __import__("json").loads((tmp_path / "jobs.json").read_text())[0]["programs"] == 1 * 4 * 3
    # --kernel grouped_gemm: its configs dump too (the grouped grid is not counted)
    gg = tmp_path / "gg"
    assert insp.main(["--kernel", "grouped_gemm", "--phase", "dump", "--out", str(gg), "--gg-configs", "16,64,4,4",
                      "--gg-shape", "8", "256", "512"]) == 0
    [job] = __import__("json").loads((gg / "jobs.json").read_text())
    assert "programs" not in job and "tt.dot" in (gg / f"{job['name']}.ttir").read_text()
