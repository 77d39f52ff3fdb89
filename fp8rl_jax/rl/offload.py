"""Optimizer offload: AdamW's moments in pinned host memory, streamed through the device a parameter group at a time.

Why: one device training a model alone holds the float32 masters (4 bytes a parameter), the float32
gradients (4-8) and AdamW's two float32 moments (8). The moments are read only by the update, so with
``TrainerConfig.offload_optimizer`` they live in pinned host memory and come to the device one group (a
decoder layer, or a top-level parameter) at a time: the gradient phase never holds them, the update only
one group's (``fp8rl_jax.rl.memory``: ``--offload-optimizer``).

How: the train state keeps its structure; only the memory kind of the moments changes
(:func:`offload_moments`, :func:`moments_to_device`), so a checkpoint restores either way. One step is one
jitted gradient program (``compute_grads``, the gradient norm, global-norm clipping, the learning rate:
what ``train_step`` does before its update) and one jitted update program per group shape, reused by
every decoder layer: optax's own AdamW (``rl.optimizer.optimizer_parts``) on the group's leaves, its
moments copied to the device before and back to the host after (asynchronous copies, so the next
group's inbound copy overlaps this group's update), params and moments donated. The
result equals ``train_step``'s: AdamW is elementwise per leaf, and the clip factor is global.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from optax.tree_utils import tree_get, tree_set

from fp8rl_jax.models import MatmulPolicy, ModelConfig
from fp8rl_jax.rl.optimizer import optimizer_parts
from fp8rl_jax.rl.state import TrainBatch, TrainState
from fp8rl_jax.rl.trainer import TRAIN_STEP_COMPILER_OPTIONS, make_train_step, step_gradients
from fp8rl_jax.rl.trainer_config import TrainerConfig

HOST_MEMORY = "pinned_host"
Metrics = dict[str, jax.Array]


def group_of(path: Sequence[Any]) -> tuple:
    """The group a parameter at ``path`` (plain keys: names and indices) is moved with: everything under one
    decoder layer (the path up to its index), else the parameter alone. FSDP gathers the same units
    (``rl.memory``)."""
    cut = next((j + 1 for j, k in enumerate(path) if isinstance(k, int)), len(path))
    return tuple(path[:cut])


def param_groups(params: Any) -> list[list[int]]:
    """Indices (in ``jax.tree.leaves`` order) of the leaves of each :func:`group_of` group."""
    groups: dict[tuple, list[int]] = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        plain = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
        groups.setdefault(group_of(plain), []).append(i)
    return list(groups.values())


def _adamw_state(opt_state: Any, clipped: bool) -> Any:
    return opt_state[1] if clipped else opt_state


def _with_adamw_state(opt_state: Any, adamw_state: Any, clipped: bool) -> Any:
    return (opt_state[0], adamw_state) if clipped else adamw_state


def _move_moments(state: TrainState, kind: str | None) -> TrainState:
    def move(tree):
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind or "device")), tree)

    opt = state.opt_state
    return state.replace(opt_state=tree_set(opt, mu=move(tree_get(opt, "mu")), nu=move(tree_get(opt, "nu"))))


def offload_moments(state: TrainState) -> TrainState:
    """``state`` with AdamW's ``mu`` and ``nu`` in pinned host memory (a copy; everything else unchanged)."""
    return _move_moments(state, HOST_MEMORY)


def moments_to_device(state: TrainState) -> TrainState:
    """``state`` with AdamW's moments back in device memory (what ``train_step`` takes)."""
    return _move_moments(state, None)


def _grads(state: TrainState, batch: TrainBatch, *, model_config: ModelConfig, policy: MatmulPolicy,
           trainer_config: TrainerConfig, clip: optax.GradientTransformation | None) -> tuple[Any, Metrics, jax.Array]:
    grads, metrics, rng = step_gradients(state, batch, model_config=model_config, policy=policy,
                                         trainer_config=trainer_config)
    if clip is not None:
        grads, _ = clip.update(grads, clip.init(grads))
    return grads, metrics, rng


def _update_group(params: list, grads: list, mu: list, nu: list, rest: Any, *,
                  adamw: optax.GradientTransformation) -> tuple[list, list, list, Any]:
    updates, new = adamw.update(grads, tree_set(rest, mu=mu, nu=nu), params)
    rest = tree_set(new, mu=None, nu=None)
    return optax.apply_updates(params, updates), tree_get(new, "mu"), tree_get(new, "nu"), rest


def _to(arrays: list, kind: str) -> list:
    return [jax.device_put(a, a.sharding.with_memory_kind(kind)) for a in arrays]


class OffloadedTrainStep:
    """``(state, batch) -> (state, metrics)`` like ``make_train_step``'s, with the moments kept in host memory
    (module note). The state must come from :func:`offload_moments`; it is consumed (donated)."""

    def __init__(self, model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig):
        clip, self._adamw = optimizer_parts(trainer_config.optimizer)
        self._clipped = clip is not None
        self._grads = jax.jit(functools.partial(_grads, model_config=model_config, policy=policy,
                                                trainer_config=trainer_config, clip=clip),
                              compiler_options=TRAIN_STEP_COMPILER_OPTIONS)
        self._update = jax.jit(functools.partial(_update_group, adamw=self._adamw), donate_argnums=(0, 2, 3))

    def __call__(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, Metrics]:
        adamw = _adamw_state(state.opt_state, self._clipped)
        mu_tree = tree_get(adamw, "mu")
        mu, nu = jax.tree.leaves(mu_tree), jax.tree.leaves(tree_get(adamw, "nu"))
        kinds = {m.sharding.memory_kind for m in (*mu, *nu)}
        if kinds != {HOST_MEMORY}:
            raise ValueError(f"the optimizer moments must be in {HOST_MEMORY} memory (offload_moments), found "
                             f"{sorted(map(str, kinds))}")
        grads, metrics, rng = self._grads(state, batch)
        params, treedef = jax.tree.flatten(state.params)
        grads = jax.tree.leaves(grads)
        rest = tree_set(adamw, mu=None, nu=None)
        new_rest = rest
        for idx in param_groups(state.params):
            p, g, m, n = ([leaves[i] for i in idx] for leaves in (params, grads, mu, nu))
            p, m, n, new_rest = self._update(p, g, _to(m, "device"), _to(n, "device"), rest)
            m, n = _to(m, HOST_MEMORY), _to(n, HOST_MEMORY)  # the device copies go as these complete
            for j, i in enumerate(idx):
                params[i], grads[i], mu[i], nu[i] = p[j], None, m[j], n[j]  # this group's gradients go
        mu_def = jax.tree.structure(mu_tree)
        adamw = tree_set(new_rest, mu=jax.tree.unflatten(mu_def, mu), nu=jax.tree.unflatten(mu_def, nu))
        new = state.replace(step=state.step + 1, params=jax.tree.unflatten(treedef, params),
                            opt_state=_with_adamw_state(state.opt_state, adamw, self._clipped), rng=rng)
        return new, metrics


def make_step(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig
              ) -> Callable[[TrainState, TrainBatch], tuple[TrainState, Metrics]]:
    """The single-device train step ``trainer_config`` asks for: :class:`OffloadedTrainStep` with
    ``offload_optimizer`` (its state through :func:`offload_moments`), else ``trainer.make_train_step``."""
    if trainer_config.offload_optimizer:
        return OffloadedTrainStep(model_config, policy, trainer_config)
    return make_train_step(model_config, policy, trainer_config)


__all__: Sequence[str] = ("HOST_MEMORY", "OffloadedTrainStep", "group_of", "make_step", "moments_to_device",
                          "offload_moments", "param_groups")
