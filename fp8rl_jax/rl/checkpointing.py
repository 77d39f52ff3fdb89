"""Orbax checkpoints of the whole :class:`~fp8rl_jax.rl.trainer.TrainState` plus a JSON data cursor,
each with a checksum that is checked when it is restored.

Layout: one folder per step, ``DIR/<step>/state`` (the TrainState pytree: step, float32 master
weights, optax state, rng; Orbax's OCDBT/Zarr array format), ``DIR/<step>/cursor`` (a JSON
dict: where the data stream stands, run metadata; anything ``json.dumps`` accepts) and
``DIR/<step>/checksum`` (JSON: a digest of every state leaf and of the cursor).

Design notes
------------
* **Atomic.** Orbax writes a step into a temporary folder (``<step>.orbax-checkpoint-tmp-*``)
  and renames it when every item is committed; a killed save leaves only the temporary folder,
  which :meth:`Checkpointer.all_steps` never lists, so ``latest_step`` is always a complete one.
  :func:`remove_unfinished_saves` deletes such leftovers; call it only while no other process
  writes into the folder (the run folder's lock, :mod:`fp8rl_jax.rl.run_dir`, says so).
* **Verified.** Orbax 0.12.4 has no checksum of the data it writes (its opt-in Zarr3 layout
  checksums only a shard's chunk index, crc32c; the default Zarr2 + zstd layout nothing), so a
  flipped bit in an array file restores silently into a different state. Each save therefore writes a third item,
  ``checksum``, in the same atomic commit: per state leaf two 32-bit sums of its bits (the plain
  word sum, which changes with any single changed word, and a sum of position-mixed words,
  murmur3's finalizer), computed on the device (a pass over the state, nothing copied to the
  host), and a SHA-256 of the cursor's JSON. :meth:`Checkpointer.restore` recomputes both from
  what it read and raises :class:`CheckpointError` naming the differing leaves. A checkpoint
  without the item (written before checksums existed) restores unverified
  (``Restored.verified`` is False).
* **Newest intact.** :meth:`Checkpointer.restore_latest` tries the steps newest first; damaged
  ones (unreadable, or failing the checksum) are reported in ``Restored.damaged`` and, once an
  intact one is found, moved to ``DIR/damaged/<step>`` (kept for inspection, out of Orbax's sight,
  so the run can write that step again). :meth:`Checkpointer.restore` with a step is strict.
* **Keep last N.** ``CheckpointConfig.max_to_keep`` (Orbax's ``max_to_keep``) deletes the
  oldest steps after each save; None keeps everything.
* **Exact resume.** Restoring needs a *target* state, concrete or abstract (``jax.eval_shape``
  of ``init_train_state``): its pytree structure, shapes, dtypes and shardings define what comes
  back, so ``nnx.State`` and optax named tuples return as themselves, bit for bit. Saving is
  synchronous by default; with ``async_save`` Orbax copies the arrays to the host before
  ``save`` returns, so donating the state to the next step right after is safe, and
  :meth:`Checkpointer.wait` (also called by ``close``) blocks until the write is committed.
* **Clear failures.** A missing folder or step raises ``FileNotFoundError`` naming what exists;
  an unreadable, damaged or mismatched checkpoint raises :class:`CheckpointError` naming the step
  folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from fp8rl_jax.rl.run_dir import RunLock
from fp8rl_jax.rl.trainer import TrainState

ITEMS = ("state", "cursor", "checksum")
CHECKSUM_FORMAT = 1
DAMAGED = "damaged"  # DIR/damaged/<step>: checkpoints set aside by restore_latest
UNFINISHED_MARK = ".orbax-checkpoint-tmp"  # Orbax's suffix of a step folder being written


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be read into the requested state, or fails its checksum."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    max_to_keep: int | None = 3  # keep the newest N steps; None keeps all
    async_save: bool = False  # write in a background thread (call Checkpointer.wait before exiting)

    def __post_init__(self) -> None:
        if self.max_to_keep is not None and not (isinstance(self.max_to_keep, int) and self.max_to_keep >= 1):
            raise ValueError(f"max_to_keep must be a positive int or None, got {self.max_to_keep!r}")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore_latest` restored.

    Attributes:
      state, cursor: the checkpoint's TrainState and JSON cursor.
      step: the step restored; ``path`` its folder.
      verified: the checkpoint carried a checksum and matched it.
      damaged: newer steps that could not be used, as ``(step, why, where it was moved)``.
    """

    state: TrainState
    cursor: dict[str, Any]
    step: int
    path: Path
    verified: bool
    damaged: tuple[tuple[int, str, Path], ...] = ()

    def messages(self) -> list[str]:
        """What a resuming run should print: each damaged newer step and where it went, and a missing checksum."""
        lines = [f"warning: {' '.join(why.split())}; moved it to {moved}; using step {self.step}"
                 for _, why, moved in self.damaged]
        if not self.verified:
            lines.append(f"note: {self.path} has no checksum (saved before checksums were written): restored unverified")
        return lines


# ------------------------------------------------------------------------------------ checksums


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as a flat uint32 vector (a PRNG key through its key data)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    if x.dtype.itemsize >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32).ravel()


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit flips about half the output bits."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@jax.jit
def _leaf_digests(leaves: list[jax.Array]) -> jax.Array:
    """``[n_leaves, 2]`` uint32: per leaf, the wrapping sum of its words and of its position-mixed
    words. Integer sums are exact and order-free, so a sharded state gives the same digest."""
    rows = []
    for x in leaves:
        w = _words(x)
        mixed = _mix(w ^ _mix(jax.lax.iota(jnp.uint32, w.size) + np.uint32(1)))
        rows.append(jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)]))
    return jnp.stack(rows) if rows else jnp.zeros((0, 2), jnp.uint32)


def reduce_leaves(fn: Any, leaves: list) -> np.ndarray:
    """``fn(leaves)`` (a jitted function of a list of arrays giving one row per leaf) on the device: the leaves in
    device memory in one call, those in host memory (offloaded optimizer moments, ``rl.offload``) one at a time
    through the device, so no more than one of them is ever copied there."""
    on_host = [getattr(getattr(x, "sharding", None), "memory_kind", None) not in (None, "device") for x in leaves]
    resident = [i for i, h in enumerate(on_host) if not h]
    rows: dict[int, np.ndarray] = dict(zip(resident, np.asarray(jax.device_get(fn([leaves[i] for i in resident])))))
    for i in (i for i, h in enumerate(on_host) if h):
        x = leaves[i]
        rows[i] = np.asarray(jax.device_get(fn([jax.device_put(x, x.sharding.with_memory_kind("device"))])))[0]
    return np.stack([rows[i] for i in range(len(leaves))]) if leaves else np.asarray(jax.device_get(fn([])))


def state_digest(state: Any) -> dict[str, str]:
    """``{leaf path: "xxxxxxxx-xxxxxxxx"}``, a checksum of every leaf's bits (reduced on the device)."""
    paths_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    sums = reduce_leaves(_leaf_digests, [x for _, x in paths_leaves])
    return {jax.tree_util.keystr(p): f"{int(a):08x}-{int(b):08x}" for (p, _), (a, b) in zip(paths_leaves, sums)}


def cursor_digest(cursor: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cursor, sort_keys=True).encode()).hexdigest()


def _checksum(state: Any, cursor: Mapping[str, Any]) -> dict[str, Any]:
    return {"format": CHECKSUM_FORMAT, "state": state_digest(state), "cursor": cursor_digest(cursor)}


def _checksum_problems(saved: Any, state: Any, cursor: Mapping[str, Any]) -> list[str]:
    if not isinstance(saved, dict) or saved.get("format") != CHECKSUM_FORMAT:
        return [f"its checksum item is not a format-{CHECKSUM_FORMAT} checksum"]
    problems = []
    got, want = state_digest(state), saved.get("state")
    if not isinstance(want, dict) or set(got) != set(want):
        problems.append("its checksum lists other state leaves than the restored state has")
    else:
        bad = [k for k in got if got[k] != want[k]]
        if bad:
            problems.append(f"{len(bad)} state leaves differ from their checksum ({', '.join(bad[:3])}"
                            f"{', ...' if len(bad) > 3 else ''})")
    if cursor_digest(cursor) != saved.get("cursor"):
        problems.append("the cursor differs from its checksum")
    return problems


# ------------------------------------------------------------------------------------ the checkpointer


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
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

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
        """Writes ``state``, the JSON ``cursor`` and their checksum as ``step`` (default
        ``state.step``); returns the step."""
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
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), cursor=ocp.args.JsonSave(cursor),
                                  checksum=ocp.args.JsonSave(_checksum(state, cursor)))
        self._manager.save(step, args=args, force=True)
        if not self.config.async_save:
            self._manager.wait_until_finished()
        return step

    def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """``(state, cursor)`` of ``step`` (default: the latest), shaped like ``target`` (a concrete or
        abstract TrainState built with the same model config and optimizer). A damaged checkpoint
        raises :class:`CheckpointError` (:meth:`restore_latest` falls back to an older one)."""
        state, cursor, _ = self._restore(target, step)
        return state, cursor

    def restore_latest(self, target: TrainState) -> Restored:
        """The newest intact checkpoint, shaped like ``target``. Newer damaged steps are listed in
        ``Restored.damaged`` and moved to ``DIR/damaged/``; when no step is intact, nothing moves and
        :class:`CheckpointError` lists every step's problem."""
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        problems: list[tuple[int, str]] = []
        for step in reversed(steps):
            try:
                state, cursor, verified = self._restore(target, step)
            except CheckpointError as e:
                problems.append((step, str(e)))
                continue
            damaged = tuple((s, why, self._set_aside(s)) for s, why in problems)
            return Restored(state, cursor, step, self.directory / str(step), verified, damaged)
        raise CheckpointError(f"no intact checkpoint in {self.directory}: " +
                              "; ".join(f"step {s}: {why}" for s, why in problems))

    def _restore(self, target: TrainState, step: int | None) -> tuple[TrainState, dict[str, Any], bool]:
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
        verified = (path / "checksum").is_dir()
        items = dict(state=ocp.args.StandardRestore(abstract), cursor=ocp.args.JsonRestore())
        if verified:
            items["checksum"] = ocp.args.JsonRestore()
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # Orbax raises many types (ValueError, KeyError, tensorstore errors...)
            raise CheckpointError(f"checkpoint {path} could not be restored into the target TrainState "
                                  f"(corrupted, incomplete, or saved for another model/optimizer): "
                                  f"{type(e).__name__}: {e}") from e
        state, cursor = restored.state, restored.cursor
        if not isinstance(cursor, dict):
            raise CheckpointError(f"checkpoint {path} has no readable cursor item")
        got = jax.tree.structure(state)
        if got != jax.tree.structure(target):
            raise CheckpointError(f"checkpoint {path} restored into a different pytree structure than the target")
        for a, t in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
            if a.shape != t.shape or a.dtype != t.dtype:
                raise CheckpointError(f"checkpoint {path} holds {a.dtype}{list(a.shape)} where the target has "
                                      f"{t.dtype}{list(t.shape)}")
        if verified:
            problems = _checksum_problems(restored.checksum, state, cursor)
            if problems:
                raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
        return state, dict(cursor), verified

    def _set_aside(self, step: int) -> Path:
        dest = self.directory / DAMAGED / str(step)
        n = 1
        while dest.exists():
            dest, n = self.directory / DAMAGED / f"{step}.{n}", n + 1
        dest.parent.mkdir(parents=True, exist_ok=True)
        (self.directory / str(step)).rename(dest)
        self._manager.reload()
        return dest

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
    absl = logging.getLogger("absl")  # Orbax warns that a read-only manager ignores save options
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        options = ocp.CheckpointManagerOptions(read_only=True, create=False)
        with ocp.CheckpointManager(directory, options=options, item_names=ITEMS) as manager:
            return manager.latest_step()
    finally:
        absl.setLevel(level)


def remove_unfinished_saves(directory: str | Path) -> list[Path]:
    """Deletes the temporary folders that killed saves left under ``directory``; returns them.
    Only for a folder no other process is saving into."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        return []
    removed = sorted(p for p in directory.iterdir() if UNFINISHED_MARK in p.name)
    for p in removed:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return removed


def open_run_notes(lock: RunLock, directory: str | Path) -> list[str]:
    """What a run starting in its folder has to say: the stale lock it took over, and the unfinished saves
    under the checkpoint ``directory`` it removed (:func:`remove_unfinished_saves`)."""
    notes = []
    if lock.replaced is not None:
        notes.append(f"took over {lock.path}, left by a run that is gone ({lock.replaced.describe()})")
    removed = remove_unfinished_saves(directory)
    if removed:
        notes.append(f"removed {len(removed)} unfinished checkpoint save(s) in {directory}: "
                     f"{', '.join(p.name for p in removed)}")
    return notes
