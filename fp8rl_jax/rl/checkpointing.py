"""Orbax checkpoints of the whole :class:`~fp8rl_jax.rl.trainer.TrainState` plus a JSON data cursor.

Layout: one folder per step, ``DIR/<step>/state`` (the TrainState pytree: step, float32 master
weights, optax state, rng; Orbax's OCDBT/Zarr array format) and ``DIR/<step>/cursor`` (a JSON
dict: where the data stream stands, run metadata; anything ``json.dumps`` accepts).

Design notes
------------
* **Atomic.** Orbax writes a step into a temporary folder (``<step>.orbax-checkpoint-tmp-*``)
  and renames it when every item is committed; a killed save leaves only the temporary folder,
  which :meth:`Checkpointer.all_steps` never lists, so ``latest_step`` is always a complete one.
* **Keep last N.** ``CheckpointConfig.max_to_keep`` (Orbax's ``max_to_keep``) deletes the
  oldest steps after each save; None keeps everything.
* **Exact resume.** Restoring needs a *target* state, concrete or abstract (``jax.eval_shape``
  of ``init_train_state``): its pytree structure, shapes, dtypes and shardings define what comes
  back, so ``nnx.State`` and optax named tuples return as themselves, bit for bit. Saving is
  synchronous by default; with ``async_save`` Orbax copies the arrays to the host before
  ``save`` returns, so donating the state to the next step right after is safe, and
  :meth:`Checkpointer.wait` (also called by ``close``) blocks until the write is committed.
* **Clear failures.** A missing folder or step raises ``FileNotFoundError`` naming what exists;
  an unreadable or mismatched checkpoint raises :class:`CheckpointError` naming the step folder.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import jax
import orbax.checkpoint as ocp

from fp8rl_jax.rl.trainer import TrainState


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be read into the requested state."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    max_to_keep: int | None = 3  # keep the newest N steps; None keeps all
    async_save: bool = False  # write in a background thread (call Checkpointer.wait before exiting)

    def __post_init__(self) -> None:
        if self.max_to_keep is not None and not (isinstance(self.max_to_keep, int) and self.max_to_keep >= 1):
            raise ValueError(f"max_to_keep must be a positive int or None, got {self.max_to_keep!r}")


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


class Checkpointer:
    """Saves and restores ``(TrainState, cursor)`` pairs under ``directory`` (created on demand)."""

    def __init__(self, directory: str | Path, config: CheckpointConfig = CheckpointConfig()):
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"checkpoint directory {self.directory} is a file")
        self.config = config
        options = ocp.CheckpointManagerOptions(max_to_keep=config.max_to_keep, create=True,
                                               enable_async_checkpointing=config.async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "cursor"))

    # ----------------------------------------------------------------------- queries

    def all_steps(self) -> list[int]:
        """Completed steps, oldest first (temporary folders of unfinished saves excluded)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ----------------------------------------------------------------------- save / restore

    def save(self, state: TrainState, cursor: Mapping[str, Any] | None = None, *, step: int | None = None) -> int:
        """Writes ``state`` and the JSON ``cursor`` as ``step`` (default ``state.step``); returns the step."""
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
        cursor = {} if cursor is None else dict(cursor)
        try:
            json.dumps(cursor)
        except TypeError as e:
            raise TypeError(f"cursor must be JSON-serializable: {e}") from None
        step = int(jax.device_get(state.step)) if step is None else int(step)
        if step in self._manager.all_steps():
            raise FileExistsError(f"checkpoint step {step} already exists in {self.directory}")
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), cursor=ocp.args.JsonSave(cursor))
        self._manager.save(step, args=args, force=True)
        if not self.config.async_save:
            self._manager.wait_until_finished()
        return step

    def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """``(state, cursor)`` of ``step`` (default: the latest), shaped like ``target`` (a concrete or
        abstract TrainState built with the same model config and optimizer)."""
        if not isinstance(target, TrainState):
            raise TypeError(f"target must be a (possibly abstract) TrainState, got {type(target).__name__}")
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; available steps: {steps}")
        path = self.directory / str(step)
        abstract = jax.tree.map(_abstract, target)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), cursor=ocp.args.JsonRestore())
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as e:  # Orbax raises many types (ValueError, KeyError, tensorstore errors...)
            raise CheckpointError(f"checkpoint {path} could not be restored into the target TrainState "
                                  f"(corrupted, incomplete, or saved for another model/optimizer): "
                                  f"{type(e).__name__}: {e}") from e
        state, cursor = restored.state, restored.cursor
        if cursor is None:
            raise CheckpointError(f"checkpoint {path} has no readable cursor item")
        got = jax.tree.structure(state)
        if got != jax.tree.structure(target):
            raise CheckpointError(f"checkpoint {path} restored into a different pytree structure than the target")
        for a, t in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
            if a.shape != t.shape or a.dtype != t.dtype:
                raise CheckpointError(f"checkpoint {path} holds {a.dtype}{list(a.shape)} where the target has "
                                      f"{t.dtype}{list(t.shape)}")
        return state, dict(cursor)

    # ----------------------------------------------------------------------- lifetime

    def wait(self) -> None:
        """Blocks until a pending asynchronous save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def latest_step(directory: str | Path) -> int | None:
    """The newest complete checkpoint step under ``directory`` (None if there is none or no folder)."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        return None
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    with ocp.CheckpointManager(directory, options=options, item_names=("state", "cursor")) as manager:
        return manager.latest_step()
