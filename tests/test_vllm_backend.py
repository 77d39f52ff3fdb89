"""The vLLM backend's CPU-testable parts: the name/layout table, the DLPack export, the sampling
mapping, the version check and the absence error. The live-vLLM test is GPU-only."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs.models import (
    qwen3_1_7b,
    qwen3_8b,
    qwen3_30b_a3b,
    tiny_qwen3,
    tiny_qwen3_moe,
)
from fp8rl_jax.checkpoint.hf import SCALE_SUFFIX, param_table
from fp8rl_jax.models.qwen3 import init_params
from fp8rl_jax.quant.policy import Kernels, LayerPolicy, quantize_params
from fp8rl_jax.rollout import vllm_backend as vb
from fp8rl_jax.rollout.base import FinishReason
from fp8rl_jax.rollout.sampling import SamplingConfig
from fp8rl_jax.rollout.vllm_names import (
    VllmLayoutError,
    abstract_quantized_params,
    check_table,
    expected_vllm_params,
    export_checkpoint,
    export_fused,
    flat_leaves,
    to_torch,
    vllm_table,
)

TINY_BLOCK = (16, 16)  # divides every tiny output size; 128 does not (tested below)
TINY_MOE_MIXED = dataclasses.replace(tiny_qwen3_moe, mlp_only_layers=(1,))
TIED = dataclasses.replace(tiny_qwen3, tie_word_embeddings=True)


# ------------------------------------------------------------------------------------ table

@pytest.mark.parametrize("config, block", [
    (tiny_qwen3, TINY_BLOCK), (tiny_qwen3_moe, TINY_BLOCK), (TINY_MOE_MIXED, TINY_BLOCK), (TIED, TINY_BLOCK),
    (dataclasses.replace(tiny_qwen3_moe, tie_word_embeddings=True), TINY_BLOCK),
    (qwen3_8b, (128, 128)), (qwen3_30b_a3b, (128, 128)), (qwen3_1_7b, (128, 128)),
], ids=["dense", "moe", "moe_with_dense_layer", "dense_tied", "moe_tied", "qwen3_8b", "qwen3_30b_a3b", "qwen3_1_7b"])
@pytest.mark.parametrize("quantized", [True, False], ids=["fp8", "bf16"])
def test_table_covers_every_tensor_exactly_once(config, block, quantized):
    params = abstract_quantized_params(config, LayerPolicy(block_size=block) if quantized else None)
    table = vllm_table(config, params)
    check_table(table, params, expected_vllm_params(config, block if quantized else None))
    names = {t.name for t in table}
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    if config.is_moe:
        e = "model.layers.0.mlp.experts.routed_experts"
        assert {f"{e}.w13_weight", f"{e}.w2_weight"} <= names
        assert (f"{e}.w13_weight_scale_inv" in names) == quantized
    n_leaf_arrays = sum(2 if quantized and hasattr(v, "scale_inv") else 1 for v in flat_leaves(params).values())
    assert sum(len(t.sources) for t in table) == n_leaf_arrays


def test_real_shapes_match_vllm():
    params = abstract_quantized_params(qwen3_30b_a3b)
    t = {x.name: x.shape for x in vllm_table(qwen3_30b_a3b, params)}
    m = "model.layers.47"
    assert t[f"{m}.self_attn.qkv_proj.weight"] == ((32 + 2 * 4) * 128, 2048)
    assert t[f"{m}.self_attn.qkv_proj.weight_scale_inv"] == (40, 16)
    assert t[f"{m}.mlp.experts.routed_experts.w13_weight"] == (128, 1536, 2048)
    assert t[f"{m}.mlp.experts.routed_experts.w13_weight_scale_inv"] == (128, 12, 16)
    assert t[f"{m}.mlp.experts.routed_experts.w2_weight_scale_inv"] == (128, 16, 6)
    assert t[f"{m}.mlp.gate.weight"] == (128, 2048)


def test_check_table_catches_errors():
    params = abstract_quantized_params(tiny_qwen3, LayerPolicy(block_size=TINY_BLOCK))
    table = vllm_table(tiny_qwen3, params)
    with pytest.raises(VllmLayoutError, match="consumed by no vLLM tensor"):
        check_table(table[:-1], params)
    with pytest.raises(VllmLayoutError, match="produced 2 times"):
        check_table(table + table[-1:], params)
    with pytest.raises(VllmLayoutError, match="is not a vLLM parameter"):
        check_table([dataclasses.replace(table[0], name="model.embed.weight"), *table[1:]], params,
                    expected_vllm_params(tiny_qwen3, TINY_BLOCK))


def test_block_straddling_fused_parts_is_refused():
    # tiny q/k out sizes (64, 32) are not multiples of 128: vLLM's validate_fp8_block_shape refuses it too
    with pytest.raises(VllmLayoutError, match="qkv_proj.*not multiples of the block rows bn=128"):
        vllm_table(tiny_qwen3, abstract_quantized_params(tiny_qwen3))
    # the last part may be ragged (vLLM allows it): v_proj out 32 with bn=64 (q=64, k=32 -> k is not last)
    with pytest.raises(VllmLayoutError, match="k_proj"):
        vllm_table(tiny_qwen3, abstract_quantized_params(tiny_qwen3, LayerPolicy(block_size=(64, 64))))


def test_mixed_precision_fused_layer_is_refused():
    from fp8rl_jax.models.policy import Proj
    from fp8rl_jax.quant.policy import FP8_PROJS
    policy = LayerPolicy(projs=FP8_PROJS - {Proj.K}, block_size=TINY_BLOCK)
    with pytest.raises(VllmLayoutError, match="mixed precision"):
        vllm_table(tiny_qwen3, abstract_quantized_params(tiny_qwen3, policy))
    # whole layers in BF16 are fine: they have no scales
    params = abstract_quantized_params(tiny_qwen3, LayerPolicy(bf16_first_layers=1, block_size=TINY_BLOCK))
    table = vllm_table(tiny_qwen3, params)
    check_table(table, params)
    names = {t.name for t in table}
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" not in names
    assert "model.layers.1.self_attn.qkv_proj.weight_scale_inv" in names


# ------------------------------------------------------------------------------------ export

@pytest.fixture(scope="module", params=[tiny_qwen3, tiny_qwen3_moe], ids=["dense", "moe"])
def quantized(request):
    config = request.param
    params = init_params(config, jax.random.key(0))
    q = quantize_params(params, config, LayerPolicy(block_size=TINY_BLOCK), Kernels.REFERENCE)
    return config, q


def test_export_fused_layout(quantized):
    config, q = quantized
    table = vllm_table(config, q)
    out = export_fused(table, q)
    assert list(out) == [t.name for t in table]
    for t in table:
        assert out[t.name].shape == t.shape and out[t.name].dtype == t.dtype, t.name
    leaves = flat_leaves(q)
    qkv = out["model.layers.1.self_attn.qkv_proj.weight"]
    attn = {p: leaves[("layers", 1, "self_attn", p, "weight")] for p in ("q_proj", "k_proj", "v_proj")}
    nq, nk = attn["q_proj"].q.shape[0], attn["k_proj"].q.shape[0]
    np.testing.assert_array_equal(np.asarray(qkv[nq:nq + nk]).view(np.uint8), np.asarray(attn["k_proj"].q).view(np.uint8))
    scale = np.asarray(out["model.layers.1.self_attn.qkv_proj.weight_scale_inv"])
    np.testing.assert_array_equal(scale[nq // TINY_BLOCK[0]:(nq + nk) // TINY_BLOCK[0]], np.asarray(attn["k_proj"].scale_inv))
    # the fused FP8 weight dequantizes with the fused scales exactly as the parts do (block rows line up)
    deq = np.asarray(qkv.astype(jnp.float32)) * np.repeat(np.repeat(scale, 16, 0), 16, 1)
    parts = np.concatenate([np.asarray(attn[p].dequantize(jnp.float32)) for p in ("q_proj", "k_proj", "v_proj")])
    np.testing.assert_array_equal(deq, parts)
    if config.is_moe:
        e = "model.layers.0.mlp.experts.routed_experts"
        ex = {p: leaves[("layers", 0, "mlp", "experts", p)] for p in ("gate_proj", "up_proj", "down_proj")}
        i = ex["gate_proj"].q.shape[1]
        w13 = np.asarray(out[f"{e}.w13_weight"]).view(np.uint8)
        np.testing.assert_array_equal(w13[:, :i], np.asarray(ex["gate_proj"].q).view(np.uint8))  # w1 = gate first
        np.testing.assert_array_equal(w13[:, i:], np.asarray(ex["up_proj"].q).view(np.uint8))
        assert out[f"{e}.w2_weight"] is ex["down_proj"].q  # single source: no copy


def test_export_checkpoint_names_are_the_hf_checkpoint(quantized):
    config, q = quantized
    table = vllm_table(config, q)
    got = dict(export_checkpoint(config, table, q))
    want = set()
    leaves = flat_leaves(q)
    for spec in param_table(config):
        for n in spec.hf_names:
            want.add(n)
            if hasattr(leaves[spec.path], "scale_inv"):
                want.add(n + SCALE_SUFFIX)
    assert set(got) == want  # exactly the tensors `fp8rl quantize` writes (what vLLM's load_weights reads)
    if config.is_moe:
        down = leaves[("layers", 0, "mlp", "experts", "down_proj")]
        np.testing.assert_array_equal(np.asarray(got["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"]),
                                      np.asarray(down.scale_inv[3]))


def test_dlpack_round_trip_is_bit_exact(quantized):
    config, q = quantized
    out = export_fused(vllm_table(config, q), q)
    assert any(a.dtype == jnp.float8_e4m3fn for a in out.values())
    for name, a in out.items():
        b = jax.dlpack.from_dlpack(a)  # jax 0.11.2 exports FP8 natively (DLPack 1.0 float8 codes)
        assert b.dtype == a.dtype and b.shape == a.shape, name
        if a.dtype == jnp.float8_e4m3fn:
            u8 = jax.lax.bitcast_convert_type(a, jnp.uint8)
            np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8)), np.asarray(u8))
            with pytest.raises(BufferError):  # numpy has no FP8: the reason for the uint8 fallback
                np.from_dlpack(a)
            np.testing.assert_array_equal(np.from_dlpack(u8), np.asarray(a).view(np.uint8))
        elif a.dtype == jnp.float32:
            np.testing.assert_array_equal(np.from_dlpack(a).view(np.uint32), np.asarray(a).view(np.uint32))


class _FakeTorch:
    """A torch stand-in whose from_dlpack is numpy's (no FP8, no BF16): exercises the uint8 fallback."""

    float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)

    @staticmethod
    def from_dlpack(x):
        return np.from_dlpack(x)


def test_to_torch_fallback_reinterprets_fp8_bytes(quantized):
    config, q = quantized
    out = {k: v for k, v in export_fused(vllm_table(config, q), q).items() if v.dtype != jnp.bfloat16}
    views = to_torch(out, torch_module=_FakeTorch)
    for name, a in out.items():
        assert views[name].dtype == np.dtype(a.dtype), name
        np.testing.assert_array_equal(views[name].view(np.uint8), np.asarray(a).view(np.uint8))


def test_to_torch_through_real_torch(quantized):
    torch = pytest.importorskip("torch", reason="torch is not installed in this venv (it comes with the vllm extra)")
    config, q = quantized
    out = export_fused(vllm_table(config, q), q)
    views = to_torch(out)
    for name, a in out.items():
        assert tuple(views[name].shape) == a.shape, name
        if a.dtype == jnp.float8_e4m3fn:
            got = views[name].view(torch.uint8).cpu().numpy()
            np.testing.assert_array_equal(got, np.asarray(a).view(np.uint8))


# ------------------------------------------------------------------------------------ backend (no vLLM)

class FakeSamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("mode", list(vb.LogprobsMode))
def test_sampling_params_mapping(mode):
    c = SamplingConfig(temperature=1.0, max_tokens=7, stop_token_ids=[5, 9], ignore_eos=True, seed=123)
    p = vb.sampling_params(c, mode, FakeSamplingParams)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (1.0, 1.0, 0, 7, 123)
    assert p.stop_token_ids == [5, 9] and p.ignore_eos is True and p.logprobs == 0 and p.n == 1
    g = vb.sampling_params(SamplingConfig(temperature=0.0, top_k=5, top_p=0.5), mode, FakeSamplingParams)
    assert (g.temperature, g.top_k, g.top_p) == (0.0, 0, 1.0)  # greedy ignores truncation, as our engine


def test_sampling_params_refuses_other_logprob_conventions():
    P, R = vb.LogprobsMode.PROCESSED, vb.LogprobsMode.RAW
    vb.sampling_params(SamplingConfig(temperature=0.7), P, FakeSamplingParams)  # no truncation: processed == ours
    with pytest.raises(ValueError, match="truncated"):
        vb.sampling_params(SamplingConfig(temperature=0.7, top_p=0.9), P, FakeSamplingParams)
    vb.sampling_params(SamplingConfig(temperature=1.0, top_k=20), R, FakeSamplingParams)  # T=1: raw == ours
    with pytest.raises(ValueError, match="without the temperature"):
        vb.sampling_params(SamplingConfig(temperature=0.7), R, FakeSamplingParams)
    with pytest.raises(ValueError, match="greedy threshold"):
        vb.sampling_params(SamplingConfig(temperature=1e-6), P, FakeSamplingParams)


def test_rollout_batch_from_vllm_outputs():
    Lp = types.SimpleNamespace
    outs = [
        Lp(outputs=[Lp(token_ids=[4, 1], logprobs=[{4: Lp(logprob=-0.5)}, {1: Lp(logprob=-1.25)}], finish_reason="stop")]),
        Lp(outputs=[Lp(token_ids=[7, 7, 7], logprobs=[{7: Lp(logprob=-0.1)}] * 3, finish_reason="length")]),
        Lp(outputs=[Lp(token_ids=[2], logprobs=[{2: Lp(logprob=-2.0)}], finish_reason="length")]),
    ]
    b = vb.rollout_batch(outs, max_len=10, prompt_lengths=[3, 3, 9])
    assert b.token_lists() == [[4, 1], [7, 7, 7], [2]]
    np.testing.assert_allclose(b.logprobs, [[-0.5, -1.25, 0], [-0.1, -0.1, -0.1], [-2.0, 0, 0]], rtol=1e-6)
    assert b.finish_reasons == [FinishReason.STOP, FinishReason.LENGTH, FinishReason.MAX_LEN]


def test_vllm_absent_names_the_extra():
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")
    with pytest.raises(ImportError, match=r"pip install 'fp8rl_jax\[vllm\]'"):
        vb.import_vllm(missing)


@pytest.mark.parametrize("version, ok", [("0.26.0", True), ("0.26.3", True), ("0.25.1", False), ("0.27.0", False),
                                         ("0.2.6", False), (None, False), ("0.26", False)])
def test_version_check(version, ok):
    fake = types.SimpleNamespace(__version__=version) if version is not None else types.SimpleNamespace()
    if ok:
        assert vb.import_vllm(lambda name: fake) is fake
    else:
        with pytest.raises(RuntimeError, match="supports vLLM 0.26.x only"):
            vb.import_vllm(lambda name: fake)


def test_config_memory_split_and_env():
    with pytest.raises(ValueError, match="cannot hold both pools"):
        vb.VLLMConfig("m", gpu_memory_utilization=0.6, jax_memory_fraction=0.4)
    c = vb.VLLMConfig("m", gpu_memory_utilization=0.5, jax_memory_fraction=0.4, kv_cache_dtype="fp8",
                      sleep=vb.SleepLevel.OFFLOAD_WEIGHTS)
    kw = c.llm_kwargs()
    assert kw["kv_cache_dtype"] == "fp8" and kw["enable_sleep_mode"] and kw["logprobs_mode"] == "processed_logprobs"
    assert "quantization" not in kw  # the FP8 folder carries its quantization_config
    assert kw["skip_tokenizer_init"] and "compilation_config" not in kw
    graphs = dataclasses.replace(c, cudagraph_capture_sizes=(8, 1, 8, 256)).llm_kwargs()
    assert graphs["compilation_config"] == {"cudagraph_capture_sizes": [1, 8, 256]}
    assert "compilation_config" not in dataclasses.replace(c, cudagraph_capture_sizes=(8,), enforce_eager=True).llm_kwargs()
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        dataclasses.replace(c, cudagraph_capture_sizes=(0, 8))
    assert vb.VLLMConfig("m", start_format=vb.StartFormat.BF16_ONLINE).llm_kwargs()["quantization"] == "fp8_per_block"
    env = c.memory_env()
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.4" and env["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    vb.check_jax_memory_fraction(c, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"})
    with pytest.raises(RuntimeError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        vb.check_jax_memory_fraction(c, {})
    env = {}
    vb._set_required_env(env)
    assert env == vb.REQUIRED_ENV
    with pytest.raises(RuntimeError, match="VLLM_USE_DEEP_GEMM_E8M0"):
        vb._set_required_env({"VLLM_USE_DEEP_GEMM_E8M0": "1"})


def test_write_kv_scale_on_fake_attention():
    class Buf:
        def __init__(self):
            self.v = 1.0

        def fill_(self, x):
            self.v = x

    attn = types.SimpleNamespace(_k_scale=Buf(), _v_scale=Buf(), _k_scale_cpu=Buf(), _v_scale_cpu=Buf(),
                                 calculate_kv_scales=True)
    vb.write_kv_scale(attn, 0.25, 0.5)
    assert (attn._k_scale.v, attn._v_scale.v, attn._k_scale_float, attn._v_scale_cpu.v) == (0.25, 0.5, 0.25, 0.5)
    assert attn.calculate_kv_scales is False


def test_importing_the_package_imports_neither_vllm_nor_torch():
    code = ("import sys, fp8rl_jax, fp8rl_jax.rollout, fp8rl_jax.rollout.vllm_names, fp8rl_jax.rollout.vllm_backend;"
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})


# ------------------------------------------------------------------------------------ GPU (live vLLM)

@pytest.mark.gpu
def test_vllm_generator_live(tmp_path):  # pragma: no cover - needs vllm==0.26 and a GPU
    """vLLM started from our FP8 checkpoint of a small random Qwen3 agrees with our W8A8 forward's
    greedy tokens and logprobs; ``update_weights`` takes effect (tokens change, and follow ours
    under the new weights), is reversible, and its DIRECT copies give the tokens of vLLM's own
    reload; KV scales land in every layer. Runs
    ``experiments/vllm_live_check.py --phase small`` in its own process: the JAX/vLLM memory split
    must be set before JAX starts."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    out = tmp_path / "small.json"
    script = Path(__file__).resolve().parents[1] / "experiments" / "vllm_live_check.py"
    subprocess.run([sys.executable, str(script), "--phase", "small", "--out", str(out)], check=True)
    r = json.loads(out.read_text())
    tf, after = r["teacher_forced"], r["after_update"]
    for t in (tf, after["teacher_forced"]):
        # as close to our BF16 FP8 forward as our own float32 FP8 forward is (the noise floor of a
        # random model, whose next-token distribution is nearly flat), and on most positions
        floor = t["floor_bf16_vs_f32"]
        assert t["argmax_agreement"] >= max(0.5, 0.75 * floor["argmax_agreement"]), t
        assert t["logprob_abs_delta"]["median"] <= 2 * floor["logprob_abs_delta"]["median"] + 0.01, t
    assert after["changed_positions"] >= 0.5, after  # other weights: other tokens
    assert r["weight_update_path"] == "direct", r["weight_update_reason"]
    assert r["direct_equals_reload"] and r["update_back_identical"] and r["kv_scales_written"], r
