"""Hammer paged-attention configs at the rollout engine's decode shapes and report any that stall.

Why: in session 6 (and, read again, in session 5's call 3) W1 rollouts on the H200 stopped
advancing 15-60 s into decoding, with the main thread blocked in the decode program's dispatch and
no error: in every stalled run the decode attention used a one-warp config of the tuning table
(2 pages per block, 5-7 pipeline stages), while the runs with the 4-warp default config finished.
A stall once in ~1e8 program instances never shows in a sweep's few dozen timed calls, so this
script runs each config on its own, in a child process, for ``--seconds`` of back-to-back calls
(tens of thousands of launches, as many as a W1 run makes before it stalled), with the lengths
moving every call; a child that stops reporting progress is killed and the config reported as
stalled. Each config also reports ms per call, so a safe replacement comes with its speed.

    python experiments/paged_attention_stall_hunt.py --seconds 25 --out experiments/results/stall_hunt.json
    python experiments/paged_attention_stall_hunt.py --child '{"pool": "bfloat16", ...}'   # one config

On the CPU (interpret mode) it runs a tiny shape for a smoke test (``--tiny``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import selectors
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.common import run_environment  # noqa: E402
from pallas_kernels.paged_attention import (DEFAULT_CONFIG, PagedAttentionConfig, bench_inputs,  # noqa: E402
                                            default_config, paged_attention)

PROGRESS_EVERY_S = 2.0


def candidates() -> list[tuple[str, PagedAttentionConfig]]:
    """(pool dtype, config), most telling first: the two one-warp configs that were in the table
    when W1 runs stalled, the table's entries now (4 warps), then faster 2- and 4-warp FP8
    candidates (word gather included)."""
    f16 = dict(fp8_dot_dtype="float16")
    out = [("float8_e4m3fn", PagedAttentionConfig(pages_per_block=2, num_warps=1, num_stages=5, **f16)),
           ("bfloat16", PagedAttentionConfig(pages_per_block=2, num_warps=1, num_stages=7)),
           ("bfloat16", default_config(jnp.bfloat16)), ("float8_e4m3fn", default_config(jnp.float8_e4m3fn)),
           ("float8_e4m3fn", PagedAttentionConfig(pages_per_block=4, num_warps=2, num_stages=6, **f16)),
           ("float8_e4m3fn", PagedAttentionConfig(pages_per_block=4, num_warps=2, num_stages=5, fp8_word_gather=True,
                                                  **f16)),
           ("float8_e4m3fn", PagedAttentionConfig(pages_per_block=4, num_warps=4, num_stages=5, **f16)),
           ("float8_e4m3fn", DEFAULT_CONFIG)]
    return list(dict.fromkeys(out))


def hammer(pool: str, config: PagedAttentionConfig, *, batch: int, context: int, seconds: float,
           interpret: bool | None = None, report=print) -> dict:
    """Calls the kernel back to back for ``seconds`` (each call synchronized, the lengths shifted
    every call so page counts and splits keep changing); ``report(line)`` every
    ``PROGRESS_EVERY_S``. Returns {"calls", "seconds", "ms_per_call"}."""
    q, k, v, ks, vs, table, lengths = bench_inputs(batch, context, jnp.dtype(pool), ragged=True)

    @jax.jit
    def call(q, shift):
        # rows shrink by up to context/2 tokens as ``shift`` cycles: every page count is visited
        n = jnp.maximum(lengths - shift, 1)
        return paged_attention(q, k, v, ks, vs, table, n, config=config, interpret=interpret)

    out = jax.block_until_ready(call(q, jnp.int32(0)))  # compile (and the output if no call fits in time)
    t0 = last = time.perf_counter()
    calls = 0
    while time.perf_counter() - t0 < seconds:
        out = call(q, jnp.int32((calls * 37) % max(context // 2, 1)))
        jax.block_until_ready(out)
        calls += 1
        if time.perf_counter() - last >= PROGRESS_EVERY_S:
            last = time.perf_counter()
            report(f"progress {calls} calls {last - t0:.1f} s")
    dt = time.perf_counter() - t0
    return {"calls": calls, "seconds": dt, "ms_per_call": dt / max(calls, 1) * 1e3,
            "finite": bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))}


def _child(spec: dict) -> int:
    config = PagedAttentionConfig(**spec["config"])
    res = hammer(spec["pool"], config, batch=spec["batch"], context=spec["context"], seconds=spec["seconds"],
                 report=lambda line: print(line, flush=True))
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def run_config(pool: str, config: PagedAttentionConfig, *, batch: int, context: int, seconds: float,
               stall_s: float, compile_s: float = 120.0, command: list[str] | None = None) -> dict:
    """One config in a child process (``command``, default this script's ``--child``); killed and
    reported stalled when no progress line arrives for ``stall_s`` seconds after the first, or
    none within ``compile_s``."""
    spec = {"pool": pool, "config": dataclasses.asdict(config), "batch": batch, "context": context,
            "seconds": seconds}
    command = [sys.executable, __file__, "--child"] if command is None else command
    proc = subprocess.Popen([*command, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    row = {"pool": pool, "config": spec["config"], "status": "stalled", "calls_before": 0}
    t_start = time.perf_counter()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    last = None
    tail: list[str] = []
    while True:
        limit = compile_s if last is None else stall_s
        ref = t_start if last is None else last
        timeout = ref + limit - time.perf_counter()
        if timeout <= 0 or not sel.select(timeout=timeout):
            proc.kill()
            break
        line = proc.stdout.readline()
        if not line:  # child exited
            proc.wait()
            if row["status"] != "ok":
                row.update(status=f"error rc={proc.returncode}", log_tail=tail[-8:])
            break
        tail.append(line.rstrip())
        if line.startswith("progress"):
            last = time.perf_counter()
            row["calls_before"] = int(line.split()[1])
        elif line.startswith("RESULT "):
            row.update(status="ok", **json.loads(line[len("RESULT "):]))
    row["wall_s"] = time.perf_counter() - t_start
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=25.0, help="back-to-back calls per config")
    ap.add_argument("--stall-s", type=float, default=15.0, help="no progress for this long = stalled")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=3072, help="rows at context/2..context keys (W1 reaches 3072)")
    ap.add_argument("--pools", nargs="*", default=["bfloat16", "float8_e4m3fn"])
    ap.add_argument("--only", type=int, default=0, help="the first N candidates only (0: all)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: batch 2, context 64, 1 s, two configs")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.child is not None:
        return _child(json.loads(a.child))
    if a.tiny:
        a.batch, a.context, a.seconds, a.stall_s = 2, 64, 1.0, 60.0
    elif jax.default_backend() != "gpu":
        print("the stall hunt needs a GPU (use --tiny for a CPU smoke run)")
        return 0
    todo = [(p, c) for p, c in candidates() if p in a.pools]
    if a.only:
        todo = todo[: a.only]
    if a.tiny:
        todo = [t for t in todo if t[0] == "bfloat16"][:1] + [t for t in todo if t[0] == "float8_e4m3fn"][:1]
    rows = []
    for pool, config in todo:
        row = run_config(pool, config, batch=a.batch, context=a.context, seconds=a.seconds, stall_s=a.stall_s)
        rows.append(row)
        c = row["config"]
        speed = f"{row['ms_per_call']:.3f} ms/call, {row['calls']} calls" if row["status"] == "ok" else \
            f"after {row['calls_before']} calls"
        print(f"{pool:14s} bp={c['pages_per_block']} pps={c['pages_per_split']} w={c['num_warps']} "
              f"st={c['num_stages']} dot={c['fp8_dot_dtype']} words={c['fp8_word_gather']}: {row['status']} ({speed})",
              flush=True)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({**run_environment(), "batch": a.batch, "context": a.context,
                                         "seconds": a.seconds, "results": rows}, indent=1) + "\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
