"""The trainer's update on a device mesh: :func:`fp8rl_jax.rl.trainer.train_step`, sharded from outside.

Design note
-----------
Nothing in the model or the trainer knows about the mesh. :func:`make_sharded_train_step` jits the
very ``train_step`` of the single-device trainer with

* ``in_shardings = out_shardings`` for the ``TrainState``: parameters by the preset's rules
  (``fp8rl_jax.parallel.rules``), the optax state following its parameters, ``step`` and ``rng``
  replicated, donated (the update happens in place, shard by shard);
* every ``TrainBatch`` field split on ``B`` over ``data x fsdp x expert`` (every axis but
  ``tensor``: a tensor group must see the same tokens; ``fp8rl_jax.parallel.batch_sharding``),
  replicated along ``tensor``;
* metrics replicated.

XLA's sharding propagation (GSPMD) places every intermediate and inserts the collectives (under
FSDP: gathers of the weights where they are used and a reduction of the gradients over the batch
shards into the parameters' layout; under tensor parallelism: column-parallel projections give
head- / FFN- / vocab-sharded activations, row-parallel ones a sum over ``tensor``). The numerics
are those of the single-device step up to the order of float32 sums (the tests hold them to ~1e-5).

What propagation does not decide well (no sharding constraint inside the model or the trainer
yet): the micro-batch split ``[B] -> [M, B/M]`` in ``compute_grads`` keeps contiguous rows
together, so with ``M > 1`` each micro-batch lives on a subset of the batch shards, and under
FSDP XLA re-lays out some weights inside the micro-batch ``scan`` by a full gather ("involuntary
full rematerialization" in its log; correct, not efficient). The MoE sort / ``ragged_dot`` is also
left to propagation (tokens gathered to the expert shards, not dispatched all-to-all). Both need
constraints or ``shard_map`` inside the model and the trainer.

An RL run (``RLConfig.parallel``) takes everything from :func:`make_mesh_trainer`: the rules follow the
mesh's sizes (:func:`mesh_rules`), the trainer-logprob pass runs on the same layout as the update, a
fresh state is built directly in that layout (:func:`init_sharded_state`: no device ever holds the whole
float32 state) and a checkpoint restores into it shard by shard (:func:`abstract_sharded_state`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.models import MatmulPolicy, ModelConfig
from fp8rl_jax.models.qwen3 import abstract_params
from fp8rl_jax.parallel.mesh import MeshAxis, MeshConfig, batch_sharding, batch_shards, mesh_sizes
from fp8rl_jax.parallel.rules import (
    Fallback,
    ShardingPreset,
    ShardingRules,
    follow_params,
    named_shardings,
    plan_params,
)
from fp8rl_jax.rl.trainer import (
    TRAIN_STEP_COMPILER_OPTIONS,
    PolicyValueParams,
    TrainBatch,
    TrainerConfig,
    TrainState,
    init_train_state,
    make_optimizer,
    train_step,
    trainer_logprobs,
)


def train_state_specs(state: TrainState, config: ModelConfig, mesh: Mesh, preset: ShardingPreset | ShardingRules,
                      *, strict: bool = False) -> tuple[TrainState, tuple[Fallback, ...]]:
    """``(TrainState of PartitionSpecs, fallbacks)`` for ``state`` (arrays or ``ShapeDtypeStruct``s)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    if isinstance(state.params, PolicyValueParams):
        raise NotImplementedError("sharding a train state with a value head (PPO + GAE) is not supported yet; "
                                  "the sharded step covers the GRPO estimators")
    plan = plan_params(state.params, config, mesh, preset, strict=strict)
    specs = TrainState(step=P(), params=plan.specs, opt_state=follow_params(state.opt_state, state.params, plan.specs),
                       rng=P())
    return specs, plan.fallbacks


def shard_train_state(state: TrainState, mesh: Mesh, preset: ShardingPreset | ShardingRules, *,
                      config: ModelConfig, strict: bool = False) -> TrainState:
    """``state`` placed on ``mesh``: parameters and their optimizer moments per ``preset``, the
    rest replicated (``jax.device_put``: the input state stays valid)."""
    specs, _ = train_state_specs(state, config, mesh, preset, strict=strict)
    return jax.device_put(state, named_shardings(specs, mesh))


@dataclasses.dataclass(frozen=True)
class ShardedTrainStep:
    """A jitted, donated ``train_step`` on a mesh; call it like the single-device one.

    Attributes:
      jitted: ``jax.jit(train_step, in_shardings, out_shardings, donate_argnums=0)`` (``.lower``
        works on it; its arguments must already be placed, see ``place``).
      mesh: the device mesh.
      state_shardings: the ``TrainState`` of ``NamedSharding``s the step consumes and produces.
      batch_sharding: the sharding of every ``TrainBatch`` field.
      fallbacks: rules of the preset that were replaced by replication.
    """

    jitted: Any
    mesh: Mesh
    state_shardings: TrainState
    batch_sharding: NamedSharding
    fallbacks: tuple[Fallback, ...]

    def place(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, TrainBatch]:
        """``(state, batch)`` on the mesh (no copy for what is already placed)."""
        if not isinstance(batch, TrainBatch):
            raise TypeError(f"batch must be a TrainBatch, got {type(batch).__name__}")
        B, n = jnp.shape(batch.tokens)[0], batch_shards(self.mesh)
        if B % n:
            sizes = {a.value: s for a, s in mesh_sizes(self.mesh).items() if a is not MeshAxis.TENSOR}
            raise ValueError(f"batch size B = {B} must be a multiple of {n}, the product of the batch mesh axes "
                             f"{sizes}")
        return jax.device_put(state, self.state_shardings), jax.device_put(batch, self.batch_sharding)

    def __call__(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict[str, jax.Array]]:
        return self.jitted(*self.place(state, batch))


def make_sharded_train_step(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig,
                            optimizer: optax.GradientTransformation | None, mesh: Mesh,
                            preset: ShardingPreset | ShardingRules, *, strict: bool = False) -> ShardedTrainStep:
    """The single-device ``train_step`` jitted on ``mesh`` with the state sharded per ``preset``
    (donated) and the batch split on ``B``. ``optimizer`` defaults to
    ``make_optimizer(trainer_config.optimizer)``; build the state with the same one
    (``init_train_state``) and place it with :func:`shard_train_state` or ``ShardedTrainStep.place``."""
    if trainer_config.offload_optimizer:
        raise ValueError("trainer.offload_optimizer is for a single-device trainer; on a mesh, shard the optimizer "
                         "state wider with parallel.fsdp instead")
    if optimizer is None:
        optimizer = make_optimizer(trainer_config.optimizer)
    abstract = jax.eval_shape(lambda p: init_train_state(p, optimizer, jnp.zeros((2,), jnp.uint32)),
                              abstract_params(model_config, jnp.float32))
    specs, fallbacks = train_state_specs(abstract, model_config, mesh, preset, strict=strict)
    state_sh = named_shardings(specs, mesh)
    batch_sh = batch_sharding(mesh)
    fn = functools.partial(train_step, model_config=model_config, policy=policy, trainer_config=trainer_config,
                           optimizer=optimizer)
    jitted = jax.jit(fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, NamedSharding(mesh, P())),
                     donate_argnums=0, compiler_options=TRAIN_STEP_COMPILER_OPTIONS)
    return ShardedTrainStep(jitted, mesh, state_sh, batch_sh, fallbacks)


def mesh_rules(mesh: Mesh | MeshConfig) -> ShardingRules:
    """The trainer's sharding rules for a mesh's sizes: FSDP over ``fsdp``, Megatron tensor parallelism
    over ``tensor``, experts over ``expert`` (each when that axis has more than one device; ``data``
    only replicates)."""
    sizes = mesh_sizes(mesh)
    rules = ShardingRules()
    for axis, preset in ((MeshAxis.FSDP, ShardingPreset.FSDP), (MeshAxis.TENSOR, ShardingPreset.TENSOR_PARALLEL),
                         (MeshAxis.EXPERT, ShardingPreset.EXPERT_PARALLEL)):
        if sizes[axis] > 1:
            rules = rules | preset.rules
    return rules


@dataclasses.dataclass(frozen=True)
class ShardedLogprobFn:
    """The jitted trainer-logprob pass on a mesh: ``(params, tokens, routing=None) -> [B, T]`` with the
    batch split on ``B`` like the train step's and the params as the train state holds them."""

    jitted: Any
    batch_sharding: NamedSharding

    def __call__(self, params: Any, tokens: jax.Array, routing: jax.Array | None = None) -> jax.Array:
        tokens = jax.device_put(tokens, self.batch_sharding)
        if routing is None:
            return self.jitted(params, tokens)
        return self.jitted(params, tokens, routing=jax.device_put(routing, self.batch_sharding))


@dataclasses.dataclass(frozen=True)
class MeshTrainer:
    """What the RL loop needs from the trainer on a mesh: the optimizer, the sharded train step, the
    sharded logprob pass, and ``place`` for a fresh or restored state."""

    mesh: Mesh
    rules: ShardingRules
    optimizer: optax.GradientTransformation
    train_step: ShardedTrainStep
    logprob_fn: ShardedLogprobFn

    def place(self, state: TrainState) -> TrainState:
        """``state`` laid out on the mesh (a copy; the input stays valid)."""
        return jax.device_put(state, self.train_step.state_shardings)


def make_mesh_trainer(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig, mesh: Mesh,
                      *, strict: bool = False) -> MeshTrainer:
    """The train step and the logprob pass of ``trainer_config`` on ``mesh``, with :func:`mesh_rules`."""
    rules = mesh_rules(mesh)
    optimizer = make_optimizer(trainer_config.optimizer)
    step = make_sharded_train_step(model_config, policy, trainer_config, optimizer, mesh, rules, strict=strict)
    logprobs = jax.jit(functools.partial(trainer_logprobs, model_config=model_config, policy=policy,
                                         trainer_config=trainer_config))
    return MeshTrainer(mesh, rules, optimizer, step, ShardedLogprobFn(logprobs, step.batch_sharding))


def init_sharded_state(trainer: MeshTrainer, params: Any, key: jax.Array) -> TrainState:
    """A fresh train state of ``params`` (any layout, e.g. BF16 on one device) built directly in the
    mesh layout: the float32 masters and the optimizer moments never exist whole on one device."""
    init = jax.jit(lambda p, k: init_train_state(p, trainer.optimizer, k),
                   out_shardings=trainer.train_step.state_shardings)
    return init(params, key)


def abstract_sharded_state(trainer: MeshTrainer, model_config: ModelConfig, key: jax.Array) -> TrainState:
    """The train state's shapes, dtypes and mesh shardings (``jax.ShapeDtypeStruct``s): the target a
    checkpoint restores into shard by shard."""
    shapes = jax.eval_shape(lambda p: init_train_state(p, trainer.optimizer, key),
                            abstract_params(model_config, jnp.float32))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                        trainer.train_step.state_shardings)
