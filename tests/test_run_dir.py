"""fp8rl_jax.rl.run_dir (one run per folder: the lock, stale locks, setting a run aside, the same-run
check) and the self-verifying checkpoints of fp8rl_jax.rl.checkpointing (checksums, falling back
to the newest intact step, unfinished saves), at the library level on tiny states, plus the AIME
script's handling of busy and foreign run folders (each stops before any training)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8rl_jax.models import init_params
from fp8rl_jax.rl import config as rlconfig
from fp8rl_jax.rl import run_dir
from fp8rl_jax.rl.checkpointing import (Checkpointer, CheckpointError, latest_step, remove_unfinished_saves,
                                        state_digest)
from fp8rl_jax.rl.run_dir import (LOCK_NAME, RunFolderBusy, RunFolderError, RunLock, config_differences, move_aside,
                                  read_config)
from fp8rl_jax.rl.trainer import init_train_state, make_optimizer
from fp8rl_jax.tokenization import char_tokenizer

from conftest import load_experiment

RUN_DIR_PY = Path(run_dir.__file__)

# A process that claims a folder with run_dir (loaded from its file: no jax import, starts fast),
# says so, then holds it until killed. With a start file it waits for that file first, so several
# start their claim at the same moment.
HOLDER = textwrap.dedent("""
    import importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location("run_dir", sys.argv[1])
    m = importlib.util.module_from_spec(spec)
    sys.modules["run_dir"] = m
    spec.loader.exec_module(m)
    folder, start = sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
    while start and not os.path.exists(start):
        time.sleep(0.001)
    try:
        m.RunLock(folder).acquire()
    except m.RunFolderBusy as e:
        print("busy", e, flush=True)
        sys.exit(3)
    print("held", flush=True)
    time.sleep(60)
""")


def _holder(folder: Path, start: Path | None = None) -> subprocess.Popen:
    args = [sys.executable, "-c", HOLDER, str(RUN_DIR_PY), str(folder)] + ([str(start)] if start else [])
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ------------------------------------------------------------------------------------ the lock


def test_a_second_process_refuses_and_a_dead_owners_lock_is_taken_over(tmp_path):
    folder = tmp_path / "run"
    holder = _holder(folder)
    try:
        assert holder.stdout.readline().strip() == "held"
        saved = json.loads((folder / LOCK_NAME).read_text())
        assert saved["pid"] == holder.pid and saved["host"] == socket.gethostname()
        with pytest.raises(RunFolderBusy, match=rf"run folder .*run is in use by another run \(pid {holder.pid} on "):
            RunLock(folder).acquire()
        assert (folder / LOCK_NAME).exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the file stays, its flock goes with the process
        holder.wait()
        holder.stdout.close()
        holder.stderr.close()
    assert (folder / LOCK_NAME).exists()
    with RunLock(folder) as lock:
        assert lock.replaced is not None and lock.replaced.pid == holder.pid
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (folder / LOCK_NAME).exists()  # released: removed
    assert not list(folder.glob(f".{LOCK_NAME}.*"))  # no temporary files left


def test_processes_starting_together_get_one_owner(tmp_path):
    folder, start = tmp_path / "run", tmp_path / "go"
    procs = [_holder(folder, start) for _ in range(4)]
    try:
        time.sleep(0.5)  # all started, waiting for the start file
        start.touch()
        firsts = [p.stdout.readline().strip() for p in procs]
        assert sum(f == "held" for f in firsts) == 1, firsts
        assert all(f == "held" or f.startswith("busy run folder") for f in firsts), firsts
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
            p.stdout.close()
            p.stderr.close()


def test_lock_in_one_process_and_lock_file_cases(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    with RunLock(folder) as lock:
        assert lock.held and lock.replaced is None
        with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()} on {socket.gethostname()}"):
            RunLock(folder).acquire()  # a second claim from the same process is a second run too
    assert not lock.held and not folder.exists()  # it created the folder, nothing else filled it: gone
    folder.mkdir()
    with RunLock(folder):
        pass
    assert folder.is_dir() and not (folder / LOCK_NAME).exists()  # a folder it did not create stays
    # an unreadable lock file nobody holds: stale
    (folder / LOCK_NAME).write_text("not json")
    with RunLock(folder) as lock:
        assert lock.replaced.command == "unreadable lock file"
    # an owner on another host that still holds the file: busy, with the file to delete once it is over
    other = run_dir.Owner(pid=1, host="elsewhere", started="2026-01-01T00:00:00Z", command="x")
    (folder / LOCK_NAME).write_text(json.dumps(other.__dict__))
    fd = os.open(folder / LOCK_NAME, os.O_RDWR)
    try:
        assert run_dir._try_flock(fd) is True
        with pytest.raises(RunFolderBusy, match=rf"pid 1 on elsewhere.*if that run is over, delete .*{LOCK_NAME}"):
            RunLock(folder).acquire()
    finally:
        os.close(fd)
    # a filesystem without flock: the pid decides on this host; another host's owner counts as alive
    monkeypatch.setattr(run_dir, "_try_flock", lambda fd: None)
    (folder / LOCK_NAME).write_text(json.dumps({**other.__dict__, "host": socket.gethostname(), "pid": os.getpid()}))
    with pytest.raises(RunFolderBusy):
        RunLock(folder).acquire()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / LOCK_NAME).write_text(json.dumps({**other.__dict__, "host": socket.gethostname(),
                                                 "pid": int(dead.stdout)}))
    with RunLock(folder) as lock:
        assert lock.replaced.pid == int(dead.stdout)
    (folder / LOCK_NAME).write_text(json.dumps(other.__dict__))
    with pytest.raises(RunFolderBusy, match="if that run is over, delete"):
        RunLock(folder).acquire()
    (folder / LOCK_NAME).unlink()
    (tmp_path / "file").write_text("")
    with pytest.raises(RunFolderError, match="is a file, not a run folder"):
        RunLock(tmp_path / "file").acquire()


# ------------------------------------------------------------------------------------ config, moving aside


def test_config_differences_and_read_config(tmp_path):
    saved = {"rl": {"seed": 0, "model": {"layers": 2, "vocab": 99}, "data": {"steps": 4}}, "random_init": True}
    same = {"rl": {"seed": 0, "model": {"layers": 2, "vocab": 99}, "data": {"steps": 8}}, "random_init": True}
    keys = ("rl.seed", "rl.model", "random_init", "model_path")
    assert config_differences(saved, same, keys) == []  # data.steps is not an identity key here
    other = {"rl": {"seed": 1, "model": {"layers": 3, "vocab": 99}}, "random_init": True, "model_path": "/w"}
    assert config_differences(saved, other, keys) == [
        "rl.seed: 0 in the folder, 1 in this run", "rl.model.layers: 2 in the folder, 3 in this run",
        'model_path: absent in the folder, "/w" in this run']
    assert read_config(tmp_path) is None
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(RunFolderError, match=r"config\.json cannot be read \(JSONDecodeError"):
        read_config(tmp_path)


def test_move_aside_keeps_the_lock_and_never_overwrites(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints" / "2").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / LOCK_NAME).write_text("{}")
    first = move_aside(folder)
    assert first.parent == tmp_path and first.name.startswith("run.20")
    assert sorted(p.name for p in first.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert [p.name for p in folder.iterdir()] == [LOCK_NAME]
    (folder / "metrics.jsonl").write_text("{}\n")
    second = move_aside(folder)  # within the same second: a suffixed name
    assert second != first and (second / "metrics.jsonl").exists() and (first / "checkpoints" / "2").is_dir()


# ------------------------------------------------------------------------------------ checkpoints


def _state(seed: int = 0):
    params = {"w": jax.random.normal(jax.random.key(seed), (64, 256)), "b": jnp.arange(7, dtype=jnp.int32)}
    return init_train_state(params, optax.adam(1e-3), jax.random.key(seed + 1))


def _flip_a_bit(step_dir: Path) -> Path:
    """Flips one bit in the middle of the step's largest array data file (random floats: stored raw)."""
    f = max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
            key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x04
    f.write_bytes(bytes(data))
    return f


def test_digest_sees_every_bit():
    state = _state()
    base = state_digest(state)
    assert base == state_digest(jax.tree.map(jnp.copy, state)) and len(base) == len(jax.tree.leaves(state))
    w = state.params["w"]
    for index, bit in ((0, 0), (5000, 31), (16383, 12)):
        flipped = jax.lax.bitcast_convert_type(w.ravel(), jnp.uint32).at[index].add(jnp.uint32(1 << bit))
        other = state.replace(params={**state.params, "w": jax.lax.bitcast_convert_type(flipped, jnp.float32)
                                      .reshape(w.shape)})
        changed = [k for k, v in state_digest(other).items() if v != base[k]]
        assert changed == ["['w']"] or changed == [".params['w']"], changed
    swapped = state.replace(params={**state.params, "b": state.params["b"][::-1]})  # same words, other places
    assert state_digest(swapped) != base


def test_bit_flip_is_detected_and_restore_latest_falls_back_by_name(tmp_path):
    root = tmp_path / "ckpt"
    states = {s: _state(s) for s in (1, 2, 3)}
    with Checkpointer(root) as ckpt:
        for s, st in states.items():
            ckpt.save(st, {"step": s}, step=s)
    target = jax.eval_shape(lambda: _state())
    _flip_a_bit(root / "3")
    with Checkpointer(root) as ckpt:
        with pytest.raises(CheckpointError, match=r"/3 is damaged: 1 state leaves differ from their checksum "
                                                  r"\(.*\['w'\]"):
            ckpt.restore(target, step=3)  # Orbax alone restores it, silently different
        got = ckpt.restore_latest(target)
        assert got.step == 2 and got.verified and got.cursor == {"step": 2} and got.path == root / "2"
        assert [(s, m) for s, _, m in got.damaged] == [(3, root / "damaged" / "3")]
        assert "/3 is damaged" in got.damaged[0][1]
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got.state.params),
                                                        jax.tree.leaves(states[2].params)))
        assert ckpt.all_steps() == [1, 2] and (root / "damaged" / "3" / "state").is_dir()
        ckpt.save(states[3], {"step": 3}, step=3)  # the run can write that step again
        assert ckpt.restore_latest(target).step == 3
    # a changed cursor and a checkpoint without a checksum (saved before checksums existed)
    cursor_file = root / "2" / "cursor" / "metadata"
    cursor_file.write_text(cursor_file.read_text().replace("2", "9"))
    with Checkpointer(root) as ckpt:
        with pytest.raises(CheckpointError, match="/2 is damaged: the cursor differs from its checksum"):
            ckpt.restore(target, step=2)
    shutil.rmtree(root / "1" / "checksum")
    _flip_a_bit(root / "3")
    with Checkpointer(root) as ckpt:
        got = ckpt.restore_latest(target)
        assert got.step == 1 and not got.verified and [s for s, _, _ in got.damaged] == [3, 2]
        assert sorted(p.name for p in (root / "damaged").iterdir()) == ["2", "3", "3.1"]
    shutil.rmtree(root / "1" / "state")
    with Checkpointer(root) as ckpt, pytest.raises(CheckpointError, match=r"no intact checkpoint in .*step 1: "):
        ckpt.restore_latest(target)
    assert latest_step(root) == 1  # nothing moved when nothing is intact


def test_unfinished_saves_are_removed(tmp_path):
    root = tmp_path / "ckpt"
    with Checkpointer(root) as ckpt:
        ckpt.save(_state(), {"step": 1}, step=1)
    (root / "2.orbax-checkpoint-tmp-1733" / "state").mkdir(parents=True)
    (root / "3.orbax-checkpoint-tmp-1734").mkdir()
    assert latest_step(root) == 1
    removed = remove_unfinished_saves(root)
    assert [p.name for p in removed] == ["2.orbax-checkpoint-tmp-1733", "3.orbax-checkpoint-tmp-1734"]
    assert sorted(p.name for p in root.iterdir()) == ["1"]
    assert remove_unfinished_saves(tmp_path / "nowhere") == []


# ------------------------------------------------------------------------------------ the AIME script


TRAIN_ROWS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)]


@pytest.fixture(scope="module")
def exp8b():
    return load_experiment("aime24_qwen3_8b")


def _cli(exp, capsys, *argv):
    capsys.readouterr()
    rc = exp.cli([*argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_aime_script_refuses_busy_and_foreign_folders_without_deleting(exp8b, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRAIN_ROWS))
    out = tmp_path / "run"
    base = ["--preset", "tiny", "--out", str(out), "--train-data", str(data), "--eval-data", str(data),
            "--set", "logging.progress=false"]
    with RunLock(out):  # another run owns the folder
        rc, _, err = _cli(exp8b, capsys, *base)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"error: run folder {out} is in use by another run (pid {os.getpid()} on" in err

    # a folder with checkpoints of a run that was not a tiny one: a fresh tiny run refuses, deletes nothing
    with Checkpointer(out / "checkpoints") as ckpt:
        ckpt.save(_state(), {"step": 2}, step=2)
    (out / "config.json").write_text(json.dumps({"random_init": False, "rl": {"seed": 7}}))
    (out / "checkpoints" / "3.orbax-checkpoint-tmp-99").mkdir()  # a killed save's leftover
    rc, printed, err = _cli(exp8b, capsys, *base)
    assert rc == 2 and "already holds checkpoints (latest step 2): pass --resume" in err
    assert "removed 1 unfinished checkpoint save(s)" in printed and "3.orbax-checkpoint-tmp-99" in printed
    assert latest_step(out / "checkpoints") == 2 and not (out / LOCK_NAME).exists()

    # --resume checks the folder is this run's: seed, model, data
    rc, _, err = _cli(exp8b, capsys, *base, "--resume")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "holds another run's checkpoints (rl.seed: 7 in the folder, 0 in this run;" in err
    assert "random_init: false in the folder, true in this run" in err and "resume_other_config=true" in err
    # told to go on anyway, it finds no checkpoint of this model: one line, no traceback
    rc, _, err = _cli(exp8b, capsys, *base, "--resume", "--set", "resume_other_config=true")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: --resume: no intact checkpoint in {out / 'checkpoints'}: step 2: ")
    assert latest_step(out / "checkpoints") == 2

    # the previous tiny run's folder: moved aside (never deleted), said where; this run then stops on
    # its own bad input (no prompt fits), before any training
    (out / "config.json").write_text(json.dumps({"random_init": True}))
    rc, printed, err = _cli(exp8b, capsys, *base, "--set", "rollout.engine.max_seq_len=32",
                            "--set", "rollout.max_new_tokens=30")
    assert rc == 2 and "prompt fits in 2 tokens" in err
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    assert len(moved) == 1 and f"note: moved the previous tiny run in {out} (checkpoints up to step 2) to {moved[0]}" \
        in printed
    assert latest_step(moved[0] / "checkpoints") == 2 and (moved[0] / "config.json").exists()
    assert latest_step(out / "checkpoints") is None


def test_aime_resume_uses_the_newest_intact_checkpoint_and_names_the_damaged_one(exp8b, tmp_path, capsys):
    """Checkpoints of the tiny preset's state written here (steps 2 and 4, a bit flipped in 4); the
    script resumes from 2 with data.steps=2, so nothing trains: the restore path end to end."""
    aime = exp8b.aime24
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRAIN_ROWS))
    out = tmp_path / "run"
    sets = [f"data.train_path={data}", f"data.eval_path={data}", f"logging.out_dir={out}", "logging.progress=false",
            "logging.tensorboard=false", "logging.plot=false"]
    config = aime.apply_overrides(aime.AimeConfig(rl=exp8b.TINY, random_init=True, overflow=aime.Overflow.TRUNCATE),
                                  sets)
    tok = char_tokenizer(aime.TINY_ALPHABET)  # the run's model: the preset's, sized to the tokenizer (as main does)
    model_cfg = dataclasses.replace(config.rl.model, vocab_size=tok.get_vocab_size(),
                                    eos_token_ids=(tok.token_to_id("<eos>"),))
    cfg = dataclasses.replace(config.rl, model=model_cfg)
    optimizer = make_optimizer(cfg.trainer_config().optimizer)
    states = {s: init_train_state(init_params(model_cfg, jax.random.key(s), jnp.float32), optimizer,
                                  jax.random.key(cfg.seed + 1)) for s in (2, 4)}
    with Checkpointer(out / "checkpoints") as ckpt:
        for s, st in states.items():
            ckpt.save(st, {"step": s, "data_cursor": 2 * s, "data_seed": cfg.data.seed, "train_examples": 3}, step=s)
    (out / "config.json").write_text(json.dumps(rlconfig.to_dict(dataclasses.replace(config, rl=cfg))))
    _flip_a_bit(out / "checkpoints" / "4")
    rc, printed, err = _cli(exp8b, capsys, "--preset", "tiny", "--out", str(out), "--train-data", str(data),
                            "--eval-data", str(data), "--resume", *[a for s in sets[3:] + ["data.steps=2"]
                                                                    for a in ("--set", s)])
    assert rc == 0, err
    ckpts = out / "checkpoints"
    assert f"warning: checkpoint {ckpts / '4'} is damaged: 1 state leaves differ from their checksum" in printed
    assert f"moved it to {ckpts / 'damaged' / '4'}; using step 2" in printed
    assert f"resumed from {ckpts / '2'}: step 2, data cursor 4" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start_step"] == 2 and summary["resumed_state_fingerprint"] == aime.fingerprint(states[2])
    assert summary["checkpoints"] == [2] and not (out / LOCK_NAME).exists()


def test_quickstart_run_folder_rules(tmp_path, capsys):
    """The quickstart's folder handling, each case stopping before the warm-up: a busy folder, a
    resume without checkpoints, a fresh run over checkpoints, a resume of another run's folder."""
    qs = load_experiment("quickstart")
    out = tmp_path / "qs"
    with RunLock(out):
        rc, _, err = _cli(qs, capsys, "--out", str(out))
    assert rc == 2 and f"error: run folder {out} is in use by another run (pid {os.getpid()}" in err
    rc, _, err = _cli(qs, capsys, "--out", str(out), "--resume")
    assert rc == 2 and f"error: --resume: no checkpoint under {out / 'checkpoints'}" in err
    with Checkpointer(out / "checkpoints") as ckpt:
        ckpt.save(_state(), {"step": 2}, step=2)
    rc, _, err = _cli(qs, capsys, "--out", str(out), "--set", "logging.checkpoint_every=2")
    assert rc == 2 and "already holds checkpoints (latest step 2): pass --resume" in err
    (out / "config.json").write_text(json.dumps(rlconfig.to_dict(qs.rlconfig.override(qs.QuickstartConfig(),
                                                                                      ["seed=5"]))))
    rc, _, err = _cli(qs, capsys, "--out", str(out), "--resume")
    assert rc == 2 and "holds another run's checkpoints (rl.seed: 5 in the folder, 0 in this run)" in err
    rc, _, err = _cli(qs, capsys, "--out", str(out), "--resume", "--set", "resume_other_config=true")
    assert rc == 2 and err.startswith(f"error: --resume: no intact checkpoint in {out / 'checkpoints'}: step 2: ")
    assert len(err.strip().splitlines()) == 1 and latest_step(out / "checkpoints") == 2
    assert not (out / LOCK_NAME).exists()
