"""Lists the collectives XLA compiles into the tensor-parallel decode step (CPU, 2 forced host devices).

The TP2 engine (Qwen3-8B shape scaled down, head_dim 128, 128-multiples so the Pallas GEMMs apply)
is built and ``_decode`` lowered and compiled as ``JaxEngine._dispatch_decode`` calls it; every
all-gather / all-reduce / reduce-scatter / all-to-all / collective-permute of the compiled module is
printed with its shape and bytes. ``--kernels pallas`` forces the Pallas kernels (interpret mode on
the CPU; its io_callback bookkeeping adds tiny s32 all-reduces that a GPU build does not have) to
see what a GPU build partitions: a pallas_call that is not under shard_map gets its operands
(FP8 weights and scales) all-gathered.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=2 python experiments/tp_hlo_collectives.py
       [--precision all|none|w8a8|kv] [--kernels auto|pallas|reference] [--dump FILE]
"""
import argparse
import dataclasses
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import qwen3_8b
from fp8rl_jax.models import Fp8Mode, abstract_params
from fp8rl_jax.parallel import MeshConfig, make_mesh
from fp8rl_jax.quant.policy import Kernels, W8A8Policy
from fp8rl_jax.rollout import engine as engine_mod
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine

# Qwen3-8B, scaled down: head_dim 128 and 128-multiples everywhere (the Pallas GEMMs' shape rule)
CFG = dataclasses.replace(qwen3_8b, vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=128, max_position_embeddings=512,
                          bos_token_id=0, eos_token_ids=(1,))
COLL = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
DT = {"f32": 4, "bf16": 2, "f8e4m3fn": 1, "s32": 4, "pred": 1, "u32": 4, "f16": 2, "s8": 1, "u8": 1}


def nbytes(shape_str):
    tot = 0
    for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_str):
        if dt in DT:
            tot += DT[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return tot


def collectives(hlo: str):
    """(computation, op, result shape, bytes) of every collective, by computation."""
    out, comp = [], None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            comp = m.group(1)
        m = COLL.search(line)
        if m and "=" in line:
            lhs = line.split("=", 1)[1].strip()
            shape = lhs[: lhs.find(m.group(0))].strip()
            meta = re.search(r'op_name="([^"]*)"', line)
            out.append((comp, m.group(1), shape, nbytes(shape), meta.group(1)[-110:] if meta else ""))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="all")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--dump", default="")
    a = ap.parse_args()
    prec = Fp8Mode[a.precision.upper()]
    kern = Kernels[a.kernels.upper()]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray((1.0 if s.ndim == 1 else 0.0) + rng.normal(0, 0.05, s.shape),
                                                jnp.bfloat16), abstract_params(CFG, jnp.bfloat16))
    cfg = EngineConfig(max_slots=8, page_size=16, num_pages=64, max_seq_len=256, steps_per_call=4,
                       prefill_batch=2, precision=prec, fp8_block=(a.block, a.block))
    mesh = make_mesh(MeshConfig(tensor=2), jax.devices()[:2])
    eng = JaxEngine(CFG, params, cfg, mesh=mesh)
    if isinstance(eng.policy, W8A8Policy):
        eng.policy = dataclasses.replace(eng.policy, kernels=kern)
        eng._static["policy"] = eng.policy
    eng.cache = eng.cache.replace(kernels=kern)
    B = cfg.max_slots
    reqs = [None] * B
    sampling, stops, remaining = eng._slot_arrays(reqs)
    last, active = jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool)
    lowered = engine_mod.decode_program().lower(eng.params, eng.cache, last, active, sampling, stops, remaining,
                                       steps=cfg.steps_per_call, **eng._static)
    hlo = lowered.compile().as_text()
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(hlo)
    print(f"precision={prec.name} kernels={kern.name} block={a.block}")
    tot = 0
    for comp, op, shape, b, name in collectives(hlo):
        print(f"  [{comp[:40]:40s}] {op:18s} {shape:45s} {b:8d} B  {name}")
        tot += b
    print(f"  total {tot} B per compile unit")


if __name__ == "__main__":
    main()
