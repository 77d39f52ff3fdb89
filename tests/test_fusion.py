"""The generator's fused projection layout (``fp8rl_jax.models.fusion``): q/k/v and gate/up as one
GEMM each, against the separate projections of the same weights."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.models import tiny_qwen3, tiny_qwen3_moe
from fp8rl_jax.models import DensePolicy, Fp8Mode, forward, init_params
from fp8rl_jax.models.fusion import FusedWeight, fuse_params, is_fused
from fp8rl_jax.numerics.fp8 import QuantizedWeight
from fp8rl_jax.quant.policy import LayerPolicy, W8A8Policy, quantize_params, quantizing_concat
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
from fp8rl_jax.rollout.sampling import SamplingConfig

# every projection a whole number of 128-row FP8 blocks: q 256, k/v 128, gate/up 384 rows
ALIGNED = dataclasses.replace(tiny_qwen3, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                              intermediate_size=384)
ALIGNED_MOE = dataclasses.replace(tiny_qwen3_moe, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                                  moe_intermediate_size=128)


def _flat(params):
    return {tuple(p): v.get_value() for p, v in nnx.to_flat_state(params)}


@pytest.mark.parametrize("quantized", [False, True])
def test_layout(quantized):
    params = init_params(ALIGNED, jax.random.key(0), jnp.float32)
    src = quantize_params(params, ALIGNED) if quantized else params
    flat, fused = _flat(src), _flat(fuse_params(src))
    for layer in range(ALIGNED.num_layers):
        for module, names, sizes in (("self_attn", ("q_proj", "k_proj", "v_proj"), (256, 128, 128)),
                                     ("mlp", ("gate_proj", "up_proj"), (384, 384))):
            head = fused[("layers", layer, module, names[0], "weight")]
            assert isinstance(head, FusedWeight) and head.sizes == sizes
            parts = [flat[("layers", layer, module, n, "weight")] for n in names]
            if quantized:
                assert isinstance(head.w, QuantizedWeight)
                np.testing.assert_array_equal(np.asarray(head.w.q, np.float32),
                                              np.concatenate([np.asarray(p.q, np.float32) for p in parts]))
                np.testing.assert_array_equal(head.w.scale_inv, np.concatenate([p.scale_inv for p in parts]))
            else:
                np.testing.assert_array_equal(head.w, np.concatenate(parts))
            for n in names[1:]:
                assert fused[("layers", layer, module, n, "weight")].shape == (0,)
        assert not isinstance(fused[("layers", layer, "self_attn", "o_proj", "weight")], FusedWeight)
    assert is_fused(fuse_params(src)) and not is_fused(src)
    refused = fuse_params(fuse_params(src))  # idempotent
    assert jax.tree.structure(refused) == jax.tree.structure(fuse_params(src))


def test_parts_that_are_not_whole_blocks_stay_separate():
    """tiny_qwen3's q has 64 rows: half a 128-row block, so its scale rows cannot be concatenated
    (its gate and up have 128 rows: they fuse); dense weights of the same model fuse."""
    params = init_params(tiny_qwen3, jax.random.key(0), jnp.float32)
    flat = _flat(fuse_params(quantize_params(params, tiny_qwen3)))
    assert isinstance(flat[("layers", 0, "self_attn", "q_proj", "weight")], QuantizedWeight)
    assert isinstance(flat[("layers", 0, "mlp", "gate_proj", "weight")], FusedWeight)
    assert isinstance(_flat(fuse_params(params))[("layers", 0, "self_attn", "q_proj", "weight")], FusedWeight)


@pytest.mark.parametrize("config,bf16_first", [(ALIGNED, 0), (ALIGNED, 1), (ALIGNED_MOE, 0), (tiny_qwen3, 0)],
                         ids=["dense", "dense-layer0-bf16", "moe", "unaligned-q"])
def test_weight_sync_quantizes_straight_into_the_fused_layout(config, bf16_first):
    """The generator's FP8 weight sync (fusion with `quantizing_concat`, then `quantize_params`) gives
    ``fuse_params(quantize_params(params))`` leaf for leaf, bit for bit: every group quantized into its
    concatenation, a BF16 layer's group fused dense, parts that are not whole blocks kept apart."""
    policy = LayerPolicy(bf16_first_layers=bf16_first)
    params = init_params(config, jax.random.key(1), jnp.float32)
    concat = functools.partial(quantizing_concat, config=config, layer_policy=policy)
    got = jax.jit(lambda p: quantize_params(fuse_params(p, concat=concat), config, policy))(params)
    want = jax.jit(lambda p: fuse_params(quantize_params(p, config, policy)))(params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), (_, b) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
        for x, y in zip(jax.tree.leaves(a.get_value()), jax.tree.leaves(b.get_value())):
            assert x.shape == y.shape and x.dtype == y.dtype, path
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8), str(path))
    if config is not ALIGNED_MOE:  # (an MoE layer's mlp is its experts)
        head = _flat(got)[("layers", 0, "mlp", "gate_proj", "weight")]
        assert isinstance(head, FusedWeight) and isinstance(head.w, QuantizedWeight) != bool(bf16_first)


@pytest.mark.parametrize("config", [ALIGNED, ALIGNED_MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("quantized", [False, True])
def test_forward_equals_separate_projections(config, quantized):
    moe = config is ALIGNED_MOE
    config = dataclasses.replace(config, num_layers=1)  # fusion is per layer; compiles dominate: one layer
    params = init_params(config, jax.random.key(1), jnp.float32)
    policy = W8A8Policy("float32") if quantized else DensePolicy("float32")
    src = quantize_params(params, config) if quantized else params
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, config.vocab_size)
    fwd = jax.jit(lambda p, t: forward(p, t, config=config, policy=policy)[0])
    want, got = fwd(src, tokens), fwd(fuse_params(src), tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if moe:  # attention and every layer's experts' gate/up fused
        flat = _flat(fuse_params(src))
        assert isinstance(flat[("layers", 0, "self_attn", "q_proj", "weight")], FusedWeight)
        for layer in range(config.num_layers):
            head = flat[("layers", layer, "mlp", "experts", "gate_proj")]
            assert isinstance(head, FusedWeight) and head.sizes == (128, 128)
            assert isinstance(head.w, QuantizedWeight) is quantized


@pytest.mark.parametrize("quantized", [False, True])
def test_expert_layout(quantized):
    """Stacked experts: ``[E, I_gate + I_up, D]``, each expert's gate rows then its up rows (the block
    scales likewise, ``[E, 2I/128, D/128]``); the up projection becomes an empty placeholder; down stays."""
    params = init_params(ALIGNED_MOE, jax.random.key(4), jnp.float32)
    src = quantize_params(params, ALIGNED_MOE) if quantized else params
    flat, fused = _flat(src), _flat(fuse_params(src))
    e, i, d = ALIGNED_MOE.num_experts, ALIGNED_MOE.moe_intermediate_size, ALIGNED_MOE.hidden_size
    for layer in range(ALIGNED_MOE.num_layers):
        key = ("layers", layer, "mlp", "experts")
        head, parts = fused[(*key, "gate_proj")], [flat[(*key, n)] for n in ("gate_proj", "up_proj")]
        assert isinstance(head, FusedWeight) and head.sizes == (i, i) and head.shape == (e, 2 * i, d)
        if quantized:
            np.testing.assert_array_equal(np.asarray(head.w.q, np.float32),
                                          np.concatenate([np.asarray(p.q, np.float32) for p in parts], axis=1))
            np.testing.assert_array_equal(head.w.scale_inv, np.concatenate([p.scale_inv for p in parts], axis=1))
        else:
            np.testing.assert_array_equal(head.w, np.concatenate(parts, axis=1))
        assert fused[(*key, "up_proj")].shape == (0,)
        assert not isinstance(fused[(*key, "down_proj")], FusedWeight)


@pytest.mark.parametrize("config", [ALIGNED, ALIGNED_MOE], ids=["dense", "moe"])
def test_engine_default_and_tokens(config):
    cfg1 = dataclasses.replace(config, num_layers=1)  # compiles dominate: one layer
    params = init_params(cfg1, jax.random.key(3), jnp.float32)
    prompts = [[5, 6, 7, 8], list(range(9, 20)), [3] * 16]  # one prefill bucket (16): one compilation per engine
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, seed=4)
    base = EngineConfig(max_slots=4, num_pages=64, max_seq_len=64, dtype="float32", steps_per_call=4)
    moe = bool(config.num_experts)

    def experts_fused(engine):
        return isinstance(_flat(engine.params).get(("layers", 0, "mlp", "experts", "gate_proj")), FusedWeight)

    # misshapen (a 1-D k_proj) and incomplete (no v_proj) params
    bad = jax.tree_util.tree_map_with_path(lambda path, p: p.ravel() if "k_proj" in jax.tree_util.keystr(path) else p,
                                           params)
    missing = nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(params) if "v_proj" not in p])
    for mode in (Fp8Mode.NONE, Fp8Mode.W8A8):
        cfg = dataclasses.replace(base, precision=mode)
        default = JaxEngine(cfg1, params, cfg)  # fused on one device; BF16 experts only when asked
        assert default.fused and is_fused(default.params)
        assert experts_fused(default) is (moe and mode is Fp8Mode.W8A8)
        engines = [default, JaxEngine(cfg1, params, dataclasses.replace(cfg, fuse_projections=False))]
        assert not is_fused(engines[1].params)
        if moe and mode is Fp8Mode.NONE:
            engines.append(JaxEngine(cfg1, params, dataclasses.replace(cfg, fuse_projections=True)))
            assert experts_fused(engines[2])
        a, *others = [e.generate(prompts, sampling) for e in engines]
        for b in others:
            assert a.token_lists() == b.token_lists()
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        default.update_weights(params)  # every update re-fuses
        assert is_fused(default.params) and experts_fused(default) is (moe and mode is Fp8Mode.W8A8)
        if mode is Fp8Mode.NONE:  # unfused BF16 swaps without a copy: refused before the swap, nothing lost
            with pytest.raises(ValueError, match=r"k_proj\.weight has shape"):
                engines[1].update_weights(bad)
            assert engines[1].generate(prompts, sampling).token_lists() == a.token_lists()
    # an engine that builds a copy frees the previous one first; the copy's jitted prepare checks the
    # params when it traces a new signature, so a refused update leaves no weights: generate says so,
    # and the next good update restores the engine
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape"):
        default.update_weights(bad)
    with pytest.raises(RuntimeError, match="update_weights failed"):
        default.generate(prompts, sampling)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.v_proj\.weight is missing"):
        default.update_weights(missing)
    default.update_weights(params)
    assert default.generate(prompts, sampling).token_lists() == a.token_lists()


def test_engine_refuses_fusion_with_a_mesh():
    from fp8rl_jax.parallel import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(tensor=1), jax.devices()[:1])
    params = init_params(ALIGNED, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="fuse_projections"):
        JaxEngine(ALIGNED, params, EngineConfig(num_pages=8, max_seq_len=32, dtype="float32", fuse_projections=True),
                  mesh=mesh)
