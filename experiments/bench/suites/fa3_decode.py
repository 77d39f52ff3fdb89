"""vLLM's FA3 paged decode attention at our paged-attention kernel's shapes (needs a GPU and vLLM).

vLLM's decode attention (FlashAttention 3 over a paged KV cache) is timed at the shapes our Pallas
paged-attention kernel is timed at, so the two can be compared kernel for kernel.

It is the peer of our paged-attention kernel's own sweep at the same shapes and byte count: W2's
decode (~104 rows, 4-7k keys) is mostly the KV read, so attention is where our BF16 step and vLLM's
differ first. Needs torch with CUDA and vLLM 0.26 importable:

    python -m experiments.bench fa3_decode --batch 104 128 256 --context 2048 5120 7168 --equal

Inputs mirror `experiments.bench.suites.paged_attention.bench_inputs`: Qwen3-8B's attention (32 query heads,
8 kv heads, head dim 128), pages of 16 tokens shuffled across a pool holding exactly the rows' pages,
every row at ``context`` keys (``--equal``, W1/W2's lockstep rows) or uniform in [context/2, context].
The call is vLLM's FA3 decode: ``flash_attn_varlen_func`` with one query token per row, ``seqused_k``,
``block_table``, causal, and the scheduler metadata vLLM's FlashAttention backend computes per step
(``get_scheduler_metadata``), with ``num_splits`` 0 (FA3's heuristic) and 32 (vLLM's cap while CUDA
graphs are on, ``VLLM_FLASH_ATTN_MAX_NUM_SPLITS_FOR_CUDA_GRAPH``). FP8 pools (E4M3) take an E4M3 query
and per-(row, kv head) descales, as vLLM passes them. Time: CUDA events around ``--chain`` back-to-back
calls, median of ``--repeats``; fractions of the device's measured copy bandwidth
(`experiments.bench.ceiling`); bytes as ``paged_attention.bytes_moved`` (the KV pages below each
row's length, K and V, plus q and the output). Each shape's first rows are checked against a float32
softmax attention of the gathered keys (``max_rel_err``).
"""

from __future__ import annotations

import argparse
import statistics

from experiments.bench.ceiling import ceiling_record, hbm_copy_bps

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


def make_inputs(torch, batch: int, context: int, pool_dtype, *, equal: bool, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if equal:
        lengths = torch.full((batch,), context, dtype=torch.int32)
    else:
        lengths = torch.randint(context // 2, context + 1, (batch,), generator=g, dtype=torch.int32)
    need = (lengths + PAGE_SIZE - 1) // PAGE_SIZE
    num_pages = int(need.sum())
    max_pages = -(-context // PAGE_SIZE) + 1
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    table = torch.zeros((batch, max_pages), dtype=torch.int32)  # entries past a row's pages: never read
    off = 0
    for b in range(batch):
        n = int(need[b])
        table[b, :n] = perm[off:off + n]
        off += n
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    dev = "cuda"
    if pool_dtype == torch.float8_e4m3fn:
        k = (torch.randn(shape, device=dev) * 64).clamp(-448, 448).to(pool_dtype)
        v = (torch.randn(shape, device=dev) * 64).clamp(-448, 448).to(pool_dtype)
        scale = 1 / 64
    else:
        k = torch.randn(shape, device=dev, dtype=pool_dtype)
        v = torch.randn(shape, device=dev, dtype=pool_dtype)
        scale = 1.0
    q = torch.randn((batch, NUM_HEADS, HEAD_DIM), device=dev, dtype=torch.bfloat16)
    return q, k, v, scale, table.to(dev), lengths.to(dev)


def bytes_moved(lengths, itemsize: int, batch: int) -> int:
    pages = int(((lengths + PAGE_SIZE - 1) // PAGE_SIZE).sum())
    return 2 * pages * PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM * itemsize + 2 * batch * NUM_HEADS * HEAD_DIM * 2


def _take(torch, pool, ids):
    """``pool[ids]`` as float32 (gathered as bytes: CUDA indexing has no float8 kernel)."""
    return pool.view(torch.uint8)[ids].view(pool.dtype).float()


def reference(torch, q, k, v, scale, table, lengths, rows: int):
    """float32 softmax attention of rows ``[0, rows)`` over their gathered keys ([rows, N, H])."""
    out = []
    group = NUM_HEADS // NUM_KV_HEADS
    for b in range(rows):
        n = int(lengths[b])
        ids = table[b, : -(-n // PAGE_SIZE)].long()
        kb = (_take(torch, k, ids) * scale).reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n]
        vb = (_take(torch, v, ids) * scale).reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n]
        kb = kb.repeat_interleave(group, dim=1)
        vb = vb.repeat_interleave(group, dim=1)
        s = torch.einsum("nh,tnh->nt", q[b].float(), kb) * HEAD_DIM**-0.5
        out.append(torch.einsum("nt,tnh->nh", torch.softmax(s, dim=-1), vb))
    return torch.stack(out)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch", type=int, nargs="*", default=[104, 128, 256])
    ap.add_argument("--context", type=int, nargs="*", default=[2048, 5120, 7168])
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float8_e4m3fn"])
    ap.add_argument("--num-splits", type=int, nargs="*", default=[0, 32])
    ap.add_argument("--equal", action="store_true", help="every row at the full context (W1/W2's lockstep rows)")
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--check-rows", type=int, default=4)


def process_env(args: argparse.Namespace) -> dict[str, str]:
    """JAX (the copy-bandwidth measurement) allocates as it goes, leaving the GPU to torch."""
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def run(args: argparse.Namespace) -> dict:
    """FA3's time per shape, pool dtype and split count; ValueError without torch, CUDA or vLLM."""
    try:  # optional: the vLLM extra
        import torch
        from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func, get_scheduler_metadata
    except ImportError as e:
        raise ValueError(f"fa3_decode needs torch with CUDA and vLLM 0.26: {e}") from e
    if not torch.cuda.is_available():
        raise ValueError("fa3_decode needs a CUDA GPU")
    ceiling = hbm_copy_bps()
    results = []
    for batch in args.batch:
        for context in args.context:
            for dname in args.dtypes:
                pool_dtype = getattr(torch, dname)
                q, k, v, scale, table, lengths = make_inputs(torch, batch, context, pool_dtype, equal=args.equal)
                cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
                max_k = int(lengths.max())
                fp8 = pool_dtype == torch.float8_e4m3fn
                qin = q.to(pool_dtype) if fp8 else q  # vLLM's FA3 with an FP8 cache takes an FP8 query
                descale = (torch.full((batch, NUM_KV_HEADS), scale, device="cuda", dtype=torch.float32)
                           if fp8 else None)
                qd = (torch.ones((batch, NUM_KV_HEADS), device="cuda", dtype=torch.float32) if fp8 else None)
                nbytes = bytes_moved(lengths.cpu(), k.element_size(), batch)
                ref = reference(torch, qin.float() if fp8 else q, k, v, scale, table, lengths, args.check_rows)
                row = {"pool": dname, "B": batch, "context": context, "equal": args.equal, "bytes": nbytes,
                       "configs": []}
                for splits in args.num_splits:
                    meta = get_scheduler_metadata(
                        batch_size=batch, max_seqlen_q=1, max_seqlen_k=max_k, num_heads_q=NUM_HEADS,
                        num_heads_kv=NUM_KV_HEADS, headdim=HEAD_DIM, cache_seqlens=lengths,
                        qkv_dtype=pool_dtype, cu_seqlens_q=cu_q, page_size=PAGE_SIZE, causal=True,
                        num_splits=splits)
                    out = torch.empty((batch, NUM_HEADS, HEAD_DIM), device="cuda", dtype=torch.bfloat16)

                    def call():
                        flash_attn_varlen_func(qin, k, v, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
                                               seqused_k=lengths, softmax_scale=HEAD_DIM**-0.5, causal=True,
                                               block_table=table, out=out, scheduler_metadata=meta,
                                               q_descale=qd, k_descale=descale, v_descale=descale,
                                               num_splits=splits, fa_version=3)

                    try:
                        call()
                        torch.cuda.synchronize()
                        err = float((out[: args.check_rows].float() - ref).abs().max() / ref.abs().max())
                        times = []
                        for _ in range(args.repeats + 1):
                            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            t0.record()
                            for _ in range(args.chain):
                                call()
                            t1.record()
                            torch.cuda.synchronize()
                            times.append(t0.elapsed_time(t1) / args.chain)
                        ms = statistics.median(times[1:])
                    except Exception as e:  # report and go on
                        row["configs"].append({"num_splits": splits, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                        print(f"{dname} B={batch} ctx={context} splits={splits}: {type(e).__name__}: {e}"[:400],
                              flush=True)
                        continue
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    pct = 100 * gbs / (ceiling / 1e9)
                    row["configs"].append({"num_splits": splits, "ms": ms, "GBps": gbs, "pct_copy_ceiling": pct,
                                           "max_rel_err": err})
                    print(f"FA3 {dname:14s} B={batch:4d} ctx{'=' if args.equal else '<='}{context:5d} "
                          f"splits={splits:2d}: {ms:.4f} ms, {gbs:7.1f} GB/s ({pct:4.1f}% of {ceiling / 1e12:.2f} TB/s), "
                          f"err {err:.1e}", flush=True)
                results.append(row)
                del q, k, v, qin
                torch.cuda.empty_cache()
    return {"cuda": torch.version.cuda, **ceiling_record(), "results": results}


SMOKE = None  # torch with CUDA and vLLM
