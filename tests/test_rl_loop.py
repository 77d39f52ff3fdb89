"""The RL loop's stages, its config tree and the prompt sources (CPU, tiny model)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3
from configs.rl import PRESETS, QUICKSTART
from fp8rl_jax.models import DensePolicy, Fp8Mode, init_params
from fp8rl_jax.rl import config as rlconfig
from fp8rl_jax.rl.algos import AdvantageEstimator, Correction, LossAgg
from fp8rl_jax.rl.loop import (MetricsLogger, build_batch, make_sft_step, plot_metrics, read_metrics, rollout, score,
                               sync_weights, with_trainer_logprobs)
from fp8rl_jax.rl.trainer import (ComputeDtype, TrainerConfig, init_train_state, make_logprob_fn, make_optimizer,
                                  token_logprobs)
from fp8rl_jax.quant.policy import GemmBackend
from fp8rl_jax.quant.training import Fp8TrainPolicy
from fp8rl_jax.rollout.base import GENERATOR_MEMBERS
from fp8rl_jax.rollout.config import EngineConfig, KvCalibration
from fp8rl_jax.rollout.engine import JaxEngine
from fp8rl_jax.rollout.sampling import SamplingConfig
from fp8rl_jax.tasks import AdditionTask, PromptDataset, exact_match_reward, load_examples


# ------------------------------------------------------------------------------------ config


def test_override_parses_by_field_type():
    cfg = rlconfig.override(QUICKSTART, [
        "rollout.temperature=0.7", "rollout.n_samples=4", "precision.rollout=w8a8", "precision.train_fp8=true",
        "algorithm.loss.agg=seq_mean_token_sum", "algorithm.loss.dual_clip=3.0", "optimizer.max_grad_norm=none",
        "algorithm.loss.correction=TOKEN_MIS", "model.eos_token_ids=(1, 2)", "data.train_path=/x.jsonl",
        "rollout.engine.sampling_draw=gumbel", "rollout.engine.swap_space_gib=4",
        "rollout.engine.decode_buckets=16,64", "rollout.engine.fuse_projections=none", "rollout.engine.fp8_gemm=triton",
        "rollout.engine.fp8_block=64,64", "rollout.engine.overlap_host=off"])
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.n_samples == 4
    assert cfg.precision.rollout is Fp8Mode.W8A8 and cfg.precision.train_fp8 is True
    assert cfg.algorithm.loss.agg is LossAgg.SEQ_MEAN_TOKEN_SUM and cfg.algorithm.loss.dual_clip == 3.0
    assert cfg.optimizer.max_grad_norm is None and cfg.algorithm.loss.correction is Correction.TOKEN_MIS
    assert cfg.model.eos_token_ids == (1, 2) and cfg.data.train_path == "/x.jsonl"
    assert QUICKSTART.rollout.temperature == 1.0  # frozen: the preset is untouched
    assert cfg.engine_config().precision is Fp8Mode.W8A8
    assert cfg.engine_config().sampling_draw.value == "gumbel" and QUICKSTART.engine_config().sampling_draw.value == "inverse_cdf"
    ec = cfg.engine_config()
    assert (ec.swap_space_gib, ec.decode_buckets, ec.fuse_projections, ec.fp8_gemm, ec.fp8_block, ec.overlap_host) == (
        4.0, (16, 64), None, GemmBackend.TRITON, (64, 64), False)
    assert isinstance(cfg.train_policy(), Fp8TrainPolicy) and isinstance(QUICKSTART.train_policy(), DensePolicy)
    tc = cfg.trainer_config()
    assert isinstance(tc, TrainerConfig) and tc.loss is cfg.algorithm.loss


@pytest.mark.parametrize("bad, match", [
    ("rollout.n_sample=4", "unknown key 'rollout.n_sample'; did you mean rollout.n_samples\\?"),
    ("rollout.max_seq_len=64", "did you mean rollout.engine.max_seq_len\\?"),  # the leaf name, found in the tree
    ("rollout.engine.swap_space=4", "did you mean rollout.engine.swap_space_gib\\?.*rollout.engine has .*record_routing"),
    ("rollout.engine.swap_space_gib=-1", "--set rollout.engine.swap_space_gib: .*swap_space_gib must be >= 0"),
    ("rollout.engine.fp8_gemm=cutlass", "rollout.engine.fp8_gemm: 'cutlass' is not one of"),
    ("rollout.engine.fp8_block=128", "not a tuple of 2 values"),
    ("rollout.engine.overlap_host=maybe", "'maybe' is not a bool"),
    ("rollout.engine.decode_buckets=16,1024", "decode_buckets must be a tuple of ints in \\[1, max_slots"),
    ("rollout.engine.precision=none", "engine's precision is set by precision.rollout"),
    ("rollout.engine.dtype=float32", "engine's dtype is set by trainer.compute_dtype"),
    ("rollout.engine.record_routing=true", "record_routing .* needs an MoE model"),
    ("rollout.max_new_tokens=32", "leaves no room for a prompt under rollout.engine.max_seq_len = 32"),
    ("roll.n_samples=4", "valid keys start with .*rollout"),
    ("rollout.n_samples=0", "rollout.n_samples must be an int >= 1"),
    ("rollout.n_samples=two", "'two' is not a valid int"),
    ("precision.rollout=fp4", "'fp4' is not one of"),
    ("rollout.top_p=1.5", "top_p"),
    ("optimizer.lr=-1", "lr must be > 0"),
    ("trainer.micro_batches=3", "must divide the batch"),
    ("rollout.engine.max_seq_len=100000", "max_position_embeddings"),
    ("rollout.engine.stall_timeout_s=-5", "stall_timeout_s must be >= 0"),
    ("rollout", "section.field=value"),
])
def test_override_rejects_bad_values_naming_the_field(bad, match):
    with pytest.raises(rlconfig.ConfigError, match=match):
        rlconfig.override(QUICKSTART, [bad])


@pytest.mark.parametrize("make, match", [
    (lambda: rlconfig.DataConfig(steps=5.0), "DataConfig.steps must be an int, got 5.0"),
    (lambda: rlconfig.PrecisionConfig(train_fp8="false"), "PrecisionConfig.train_fp8 must be a bool, got 'false'"),
    (lambda: rlconfig.TrainConfig(logits_chunk=1024.5), "TrainConfig.logits_chunk must be an int | None"),
    (lambda: rlconfig.RolloutConfig(temperature=True), "RolloutConfig.temperature must be a float, got True"),
    (lambda: rlconfig.LoggingConfig(checkpoint_every="2"), "LoggingConfig.checkpoint_every must be an int"),
    (lambda: rlconfig.PrecisionConfig(rollout="all"), "PrecisionConfig.rollout must be a Fp8Mode, got 'all'"),
    (lambda: EngineConfig(decode_buckets=(16, 32.0)), "EngineConfig.decode_buckets must be a tuple"),
    (lambda: dataclasses.replace(tiny_qwen3, tie_word_embeddings="false"), "ModelConfig.tie_word_embeddings"),
    (lambda: TrainerConfig(micro_batches=np.float32(2)), "TrainerConfig.micro_batches must be an int"),
    (lambda: rlconfig.RLConfig(model=tiny_qwen3, seed=None), "RLConfig.seed must be an int, got None"),
])
def test_config_fields_are_checked_by_type_where_they_are_made(make, match):
    """A value of the wrong type fails on construction, naming the class, the field and the value (a
    string "false" is truthy, a float where an int is due would truncate later); ints stand for floats."""
    with pytest.raises(ValueError, match=match.replace("|", r"\|").replace("(", r"\(")):
        make()
    rlconfig.RolloutConfig(temperature=1, top_p=1)
    with pytest.raises(rlconfig.ConfigError, match="sweep trainer.remat: TrainConfig.remat must be a bool, got 1"):
        list(rlconfig.sweep(QUICKSTART, {"trainer.remat": [1]}))


def test_sweep_and_presets():
    cfgs = list(rlconfig.sweep(QUICKSTART, {"precision.rollout": ["none", "all"], "optimizer.lr": [1e-4, 3e-4]}))
    assert [(c.precision.rollout, c.optimizer.lr) for c in cfgs] == [
        (Fp8Mode.NONE, 1e-4), (Fp8Mode.NONE, 3e-4), (Fp8Mode.ALL, 1e-4), (Fp8Mode.ALL, 3e-4)]
    for name, cfg in PRESETS.items():  # every preset validates and serializes
        json.dumps(rlconfig.to_dict(cfg))
        assert cfg.engine_config().precision is Fp8Mode.ALL, name
    # full-size runs exit on a stalled decode (and resume from a checkpoint); the quickstart is off
    assert PRESETS["aime24_qwen3_8b"].engine_config().stall_timeout_s == 900.0
    assert QUICKSTART.engine_config().stall_timeout_s == 0.0
    assert rlconfig.AlgorithmConfig(estimator=AdvantageEstimator.GAE).uses_value_head  # PPO + GAE: tests/test_value_head.py


def test_presets_give_the_engine_the_settings_they_always_had():
    """The presets' engine settings, field by field (the RL-level fields filled in): the quickstart's
    numbers depend on them. The 30B-A3B preset adds MoE routing replay."""
    quick = EngineConfig(max_slots=256, page_size=8, kv_budget_gib=0.004, max_seq_len=32, steps_per_call=5,
                         prefill_batch=256, precision=Fp8Mode.ALL, dtype="bfloat16",
                         kv_calibration=KvCalibration.INFERENCE)
    aime = EngineConfig(max_slots=256, page_size=16, kv_budget_fraction=0.85, max_seq_len=22_528, steps_per_call=16,
                        prefill_batch=16, precision=Fp8Mode.ALL, dtype="bfloat16", stall_timeout_s=900.0)
    assert QUICKSTART.engine_config() == quick
    assert PRESETS["aime24_qwen3_8b"].engine_config() == aime
    assert PRESETS["aime24_qwen3_30b_a3b"].engine_config() == dataclasses.replace(aime, record_routing=True)
    # the rollout section's defaults: EngineConfig's, with a wider decode batch and prefill call
    default = rlconfig.RLConfig(model=dataclasses.replace(tiny_qwen3, max_position_embeddings=4096)).engine_config()
    assert default == EngineConfig(max_slots=64, prefill_batch=16, precision=Fp8Mode.ALL)


def test_engine_fields_the_rl_level_sets():
    """``rollout.engine`` may repeat what the RL level sets, never contradict it; ``engine_config``
    fills those fields in from the RL level."""
    base = dict(model=dataclasses.replace(tiny_qwen3, max_position_embeddings=4096),
                precision=rlconfig.PrecisionConfig(rollout=Fp8Mode.KV))
    same = rlconfig.RLConfig(rollout=rlconfig.RolloutConfig(engine=EngineConfig(precision=Fp8Mode.KV)), **base)
    assert same.engine_config().precision is Fp8Mode.KV
    with pytest.raises(rlconfig.ConfigError, match="rollout.engine.precision = w8a8 disagrees with precision.rollout"
                                                   " = kv, which sets it: set precision.rollout instead"):
        rlconfig.RLConfig(rollout=rlconfig.RolloutConfig(engine=EngineConfig(precision=Fp8Mode.W8A8)), **base)
    f32 = rlconfig.override(rlconfig.RLConfig(**base), ["trainer.compute_dtype=float32",
                                                        "precision.kv_calibration=trainer"])
    ec = f32.engine_config()
    assert (ec.dtype, ec.kv_calibration, ec.precision) == ("float32", KvCalibration.TRAINER, Fp8Mode.KV)
    assert f32.rollout.engine.dtype == "bfloat16"  # the section itself is left as given


def test_routing_replay_preset_and_override_order():
    """The 30B-A3B preset records MoE routing (the loop's batches then replay it); turning it off to
    run on vLLM works in either order of the two assignments, and not without it."""
    moe = PRESETS["aime24_qwen3_30b_a3b"]
    assert moe.engine_config().record_routing and not PRESETS["aime24_qwen3_8b"].engine_config().record_routing
    for sets in (["rollout.backend=vllm", "rollout.engine.record_routing=false"],
                 ["rollout.engine.record_routing=false", "rollout.backend=vllm"]):
        cfg = rlconfig.override(moe, sets)
        assert cfg.rollout.backend is rlconfig.RolloutBackend.VLLM and not cfg.rollout.engine.record_routing
    with pytest.raises(rlconfig.ConfigError, match="record_routing .* needs rollout.backend=jax"):
        rlconfig.override(moe, ["rollout.backend=vllm"])
    assert rlconfig.override(QUICKSTART, ["data.steps=3", "data.steps=5"]).data.steps == 5  # the last one wins


def test_config_keys_cover_every_engine_field():
    keys = rlconfig.config_keys(QUICKSTART)
    assert {f"rollout.engine.{f.name}" for f in dataclasses.fields(EngineConfig)} <= set(keys)
    for key in keys:  # every key round-trips through override as its own string form
        value = functools.reduce(getattr, key.split("."), QUICKSTART)
        if key.split(".")[-1] in rlconfig.ENGINE_FIELDS_FROM_RL and key.startswith("rollout.engine."):
            continue
        text = value.value if isinstance(value, enum.Enum) else ",".join(map(str, value)) if isinstance(value, tuple) \
            else str(value)
        if isinstance(value, tuple) and not value:
            text = "()"
        assert rlconfig.to_dict(rlconfig.override(QUICKSTART, [f"{key}={text}"])) == rlconfig.to_dict(QUICKSTART), key


@dataclasses.dataclass(frozen=True)
class _Experiment:
    rl: rlconfig.RLConfig = QUICKSTART
    sft_steps: int = 10


def test_experiment_configs_take_the_same_keys():
    """An experiment's config that holds an RLConfig takes the RL keys without a prefix (and with
    one), its own fields by name; an unknown key lists the valid ones nearby."""
    a = rlconfig.override(_Experiment(), ["data.steps=3", "sft_steps=4", "rollout.engine.swap_space_gib=2"])
    b = rlconfig.override(_Experiment(), ["rl.data.steps=3", "sft_steps=4", "rl.rollout.engine.swap_space_gib=2"])
    assert a == b and (a.rl.data.steps, a.sft_steps, a.rl.rollout.engine.swap_space_gib) == (3, 4, 2.0)
    with pytest.raises(rlconfig.ConfigError, match="unknown key 'sft_step'; did you mean sft_steps\\?"):
        rlconfig.override(_Experiment(), ["sft_step=4"])
    with pytest.raises(rlconfig.ConfigError, match="did you mean data.steps\\?"):
        rlconfig.override(_Experiment(), ["rl.data.step=4"])
    with pytest.raises(rlconfig.ConfigError, match="engine's precision is set by precision.rollout"):
        rlconfig.override(_Experiment(), ["rl.rollout.engine.precision=all"])


# ------------------------------------------------------------------------------------ tasks and data


def test_addition_task_and_reward():
    ex = AdditionTask(3).sample(np.random.default_rng(0), 200)
    for e in ex:
        a, b = e.prompt[:-1].split("+")
        assert len(a) == len(b) == 3 and int(a) + int(b) == int(e.answer)
    assert exact_match_reward(" 46 ", "46") == 1.0 and exact_match_reward("461", "46") == 0.0
    with pytest.raises(ValueError, match="digits"):
        AdditionTask(0)


def test_load_examples_jsonl_and_errors(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n\n"
                    + json.dumps({"prompt": [{"role": "user", "content": "Q2"}], "reward_model": {"ground_truth": 7}}) + "\n")
    ex = load_examples(good, template="<{question}>")
    assert [(e.prompt, e.answer) for e in ex] == [("<1+1?>", "2"), ("<Q2>", "7")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match="row 1 has no question .* or no answer"):
        load_examples(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl:1: not valid JSON"):
        load_examples(broken)
    with pytest.raises(ValueError, match="does not exist"):
        load_examples(tmp_path / "missing.jsonl")


def test_prompt_dataset_epochs_and_resumable_cursor():
    ds = PromptDataset([AdditionTask(1).sample(np.random.default_rng(i), 1)[0] for i in range(5)], seed=3)
    first = ds.next_batch(7)
    assert sorted(e.prompt for e in first[:5]) == sorted(e.prompt for e in ds.examples)  # epoch 0 is a permutation
    resumed = PromptDataset(ds.examples, seed=3, cursor=ds.cursor)
    assert ds.next_batch(6) == resumed.next_batch(6)


# ------------------------------------------------------------------------------------ stages


# the reference logprobs jitted: one compilation instead of one per op (seconds on the CPU)
_jit_token_logprobs = jax.jit(token_logprobs, static_argnames=("config", "policy"))


def _tiny(num_layers: int):
    cfg = dataclasses.replace(tiny_qwen3, vocab_size=32, eos_token_ids=(1,), num_layers=num_layers)
    return cfg, init_params(cfg, jax.random.key(0), jnp.float32)


@pytest.fixture(scope="module")
def tiny_setup():
    """One decoder layer: the stages do not depend on depth, and XLA's CPU compile of every engine and
    trainer program (what these tests cost) grows with it."""
    return _tiny(1)


@pytest.fixture(scope="module")
def tiny_setup_two_layers():
    """Two decoder layers, for what crosses layers (a later layer's KV scale moves with an earlier one)."""
    return _tiny(2)


def _engine(cfg, params, precision=Fp8Mode.NONE, dtype="float32", **kw):
    ec = EngineConfig(max_slots=8, page_size=4, num_pages=64, max_seq_len=32, steps_per_call=4, prefill_batch=8,
                      precision=precision, dtype=dtype, **kw)
    return JaxEngine(cfg, params, ec)


def test_rollout_score_build_batch_and_trainer_logprobs(tiny_setup):
    """End to end through the stages in float32: the batch puts prompt + response, mask, rollout
    logprobs and group advantages where they belong, and the trainer's logprobs of the rollout
    tokens equal the engine's (ratio 1: same precision)."""
    cfg, params = tiny_setup
    engine = _engine(cfg, params)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    G = 4
    ro = rollout(engine, prompts, n_samples=G, sampling=lambda s: SamplingConfig(temperature=1.0, max_tokens=6, seed=s),
                 step=3, seed=1)
    assert ro.group_ids.tolist() == [0] * G + [1] * G + [2] * G and len(ro.prompts) == 3 * G
    assert len({tuple(t) for t in ro.batch.token_lists()[:G]}) > 1  # distinct seeds within a group
    answers = ["x", "y", "z"]
    reward_fn = lambda text, ans: float(len(text) % 2 == 0) + (0.5 if ans == "y" else 0.0)  # noqa: E731
    decode = lambda ids: "a" * len(ids)  # noqa: E731
    rewards, texts = score(ro, answers, reward_fn, decode)
    np.testing.assert_allclose(rewards, [float(n % 2 == 0) + (0.5 if g == 1 else 0.0)
                                         for n, g in zip(ro.batch.lengths, ro.group_ids)])
    batch = build_batch(ro, rewards, estimator=AdvantageEstimator.GRPO_NO_STD, pad_multiple=8)
    B, T = batch.tokens.shape
    assert B == 3 * G and T % 8 == 0
    toks, mask, rlp, adv = (np.asarray(x) for x in (batch.tokens, batch.loss_mask, batch.rollout_logprobs,
                                                    batch.advantages))
    for i, (p, r, lp) in enumerate(zip(ro.prompts, ro.batch.token_lists(), ro.batch.logprob_lists())):
        n = len(p) + len(r)
        assert toks[i, :n].tolist() == p + r and mask[i, len(p):n].all() and mask[i].sum() == len(r)
        np.testing.assert_allclose(rlp[i, len(p):n], lp)
        group = rewards[ro.group_ids == ro.group_ids[i]]
        np.testing.assert_allclose(adv[i, len(p):n], rewards[i] - group.mean(), atol=1e-6)
        assert not adv[i, n:].any() and not adv[i, :len(p)].any()
    tc = TrainerConfig(compute_dtype=ComputeDtype.FLOAT32)
    logprob_fn = make_logprob_fn(cfg, DensePolicy("float32"), tc)
    batch = with_trainer_logprobs(batch, logprob_fn, params)
    old = np.asarray(batch.old_logprobs)
    np.testing.assert_allclose(old[mask > 0], rlp[mask > 0], atol=1e-4)
    assert not old[mask == 0].any()
    ref, _ = _jit_token_logprobs(params, batch.tokens, config=cfg, policy=DensePolicy("float32"))
    np.testing.assert_allclose(old[mask > 0], np.asarray(ref)[mask > 0], atol=1e-5)


def test_build_batch_rejects_bad_rewards(tiny_setup):
    cfg, params = tiny_setup
    ro = rollout(_engine(cfg, params), [[5, 6]], n_samples=2,
                 sampling=lambda s: SamplingConfig(temperature=1.0, max_tokens=3, seed=s), step=0)
    with pytest.raises(ValueError, match="NaN/Inf at samples \\[1\\]"):
        build_batch(ro, np.array([1.0, np.nan], np.float32))
    with pytest.raises(ValueError, match="shape \\[2\\]"):
        build_batch(ro, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="one answer per prompt"):
        score(ro, ["a", "b"], exact_match_reward, str)


def test_sync_weights_trainer_side_kv_scales_follow_the_update(tiny_setup_two_layers):
    cfg, params = tiny_setup_two_layers
    engine = _engine(cfg, params, precision=Fp8Mode.ALL, dtype="bfloat16", kv_calibration=KvCalibration.TRAINER)
    tokens = np.random.default_rng(0).integers(2, cfg.vocab_size, (4, 8)).astype(np.int32)
    lengths = np.array([8, 6, 5, 8], np.int32)
    sync_weights(engine, params, model_config=cfg, precision=Fp8Mode.ALL, kv_calibration=KvCalibration.TRAINER,
                 calibration_tokens=tokens, calibration_lengths=lengths)
    k1 = np.asarray(engine.cache.k_scale).copy()
    assert engine.kv_scales_fresh
    # K after k_norm doubles with the k_norm weight (a larger k_proj would not move it: k_norm undoes it)
    bigger = jax.tree_util.tree_map_with_path(
        lambda path, p: p * 2.0 if "k_norm" in jax.tree_util.keystr(path) else p, params)
    sync_weights(engine, bigger, model_config=cfg, precision=Fp8Mode.ALL, kv_calibration=KvCalibration.TRAINER,
                 calibration_tokens=tokens, calibration_lengths=lengths)
    assert engine.kv_scales_fresh
    k2 = np.asarray(engine.cache.k_scale)
    np.testing.assert_allclose(k2[0], 2 * k1[0], rtol=1e-3)  # the first layer's input is unchanged
    assert np.all(k2 > 1.5 * k1), (k1, k2)  # later layers' inputs move with the earlier attention
    with pytest.raises(ValueError, match="calibration_tokens"):
        sync_weights(engine, params, model_config=cfg, precision=Fp8Mode.ALL, kv_calibration=KvCalibration.TRAINER)


def test_sft_step_lowers_the_masked_cross_entropy(tiny_setup):
    cfg, params = tiny_setup
    tc = TrainerConfig(compute_dtype=ComputeDtype.FLOAT32)
    opt = make_optimizer(dataclasses.replace(tc.optimizer, lr=1e-2))
    state = init_train_state(params, opt, jax.random.key(1))
    step = make_sft_step(cfg, DensePolicy("float32"), tc, opt)
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (4, 6)).astype(np.int32))
    mask = jnp.zeros((4, 6)).at[:, 3:].set(1.0)
    losses = []
    for _ in range(8):
        state, m = step(state, tokens, mask)
        losses.append(float(m["loss"]))
    logp, _ = _jit_token_logprobs(params, tokens, config=cfg, policy=DensePolicy("float32"))
    m0 = np.asarray(mask).copy()
    np.testing.assert_allclose(losses[0], -(np.asarray(logp) * m0).sum() / m0.sum(), rtol=1e-5)
    assert losses[-1] < 0.5 * losses[0]


def test_metrics_logger_jsonl_tensorboard_and_plot(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True) as log:
        for s in range(3):
            log.log(s, {"reward/mean": s / 2, "mismatch/kl_k3": np.float32(1e-3), "bad": float("nan")})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows] == [0.0, 0.5, 1.0] and rows[0]["bad"] is None
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "p.png", [("r", ["reward/mean"]), ("kl", ["mismatch/kl_k3"])])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _ProtocolOnly:
    """A generator seen through the ``Generator`` protocol only: any other attribute raises."""

    def __init__(self, inner):
        self._inner, self.used = inner, set()

    def __getattr__(self, name):
        if name not in GENERATOR_MEMBERS:
            raise AttributeError(f"the RL loop used {name!r}, which is not in the Generator protocol")
        self.used.add(name)
        return getattr(self._inner, name)


def test_rl_step_sleeping_engine_frees_the_pool_and_changes_nothing(tiny_setup):
    """``rollout.sleep_while_training``: after each step's rollout the engine's KV pool and weight
    copy are freed (the trainer's update runs without them; the weight sync hands new weights
    over) and the next rollout allocates the pool
    again; two steps give the same metrics and params as with the pool kept (float32, FP8 KV with
    trainer-side scales synced while asleep). The loop sees the engine through the ``Generator``
    protocol only (``_ProtocolOnly`` raises on anything else)."""
    from fp8rl_jax.rl.loop import Task, rl_step
    from fp8rl_jax.rl.trainer import make_train_step
    from fp8rl_jax.tasks import Example

    cfg, params = tiny_setup

    def run_two(sleep: bool):
        rc = rlconfig.RLConfig(
            model=cfg,
            rollout=rlconfig.RolloutConfig(n_samples=2, max_new_tokens=5, sleep_while_training=sleep,
                                           engine=EngineConfig(max_seq_len=32, max_slots=8, page_size=4,
                                                               steps_per_call=4, prefill_batch=8)),
            trainer=rlconfig.TrainConfig(micro_batches=1, compute_dtype=ComputeDtype.FLOAT32),
            precision=rlconfig.PrecisionConfig(rollout=Fp8Mode.KV, kv_calibration=KvCalibration.TRAINER),
            data=rlconfig.DataConfig(prompts_per_step=2, steps=2, eval_every=0))
        engine = _engine(cfg, params, Fp8Mode.KV, kv_calibration=KvCalibration.TRAINER)
        sync_weights(engine, params, model_config=cfg, dtype=jnp.float32, precision=Fp8Mode.KV,
                     kv_calibration=KvCalibration.TRAINER, calibration_tokens=np.full((2, 8), 5, np.int32),
                     calibration_lengths=np.array([8, 8], np.int32))
        rng = np.random.default_rng(0)
        task = Task(next_batch=lambda n: [Example(prompt="ab"[: 1 + int(rng.integers(2))], answer="")
                                          for _ in range(n)],
                    encode=lambda s: [3 + (ord(c) % 20) for c in s], decode=lambda ids: "x" * len(ids),
                    reward_fn=lambda text, ans: float(len(text) % 2 == 0))
        tc, policy = rc.trainer_config(), rc.train_policy()
        opt = make_optimizer(rc.optimizer)
        state = init_train_state(params, opt, jax.random.key(1))
        train_step, logprob_fn = make_train_step(cfg, policy, tc, opt), make_logprob_fn(cfg, policy, tc)
        train = train_step
        if sleep:  # the trainer's update runs with the pool freed
            def train(s, b):
                assert engine.asleep and engine.params is None
                return train_step(s, b)
        strict = _ProtocolOnly(engine)
        rows = []
        for step in range(2):
            state, m = rl_step(step, state, cfg=rc, task=task, engine=strict, train_step=train,
                               logprob_fn=logprob_fn, model_config=cfg)
            assert engine.asleep == sleep and engine.kv_scales_fresh
            rows.append({k: v for k, v in m.items() if not k.startswith("time/") and "per_s" not in k})

        assert strict.used == {"generate", "update_weights", "set_kv_scales", "params"} | ({"sleep"} if sleep else set())
        return rows, state

    rows_kept, state_kept = run_two(False)
    rows_slept, state_slept = run_two(True)
    assert rows_slept == rows_kept
    jax.tree.map(np.testing.assert_array_equal, state_slept.params, state_kept.params)
