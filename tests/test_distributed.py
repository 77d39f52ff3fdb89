"""Multi-host start (``fp8rl_jax.parallel.distributed``): the environment parsing, and two real
processes on this machine (2 CPU devices each, Gloo collectives) that find each other through
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` and reduce one array sharded
over all 4 devices of both."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_devices_env

from fp8rl_jax.parallel.distributed import DistributedConfigError, initialize_distributed, settings_from_env

REPO = Path(__file__).resolve().parents[1]


def test_settings_from_each_source():
    s = settings_from_env({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert (s.source, s.coordinator_address, s.num_processes, s.process_id) == ("jax", "10.0.0.1:1234", 2, 1)
    s = settings_from_env({"MASTER_ADDR": "h0", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "RANK": "3"})
    assert (s.source, s.coordinator_address, s.num_processes, s.process_id) == ("torchrun", "h0:29500", 4, 3)
    assert settings_from_env({"SLURM_JOB_ID": "7"}).source == "cluster"
    assert settings_from_env({}).source == "single"
    assert initialize_distributed({}).source == "single"  # one process: nothing to start
    one = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}
    assert initialize_distributed(one).num_processes == 1  # a 1-process "cluster" is left alone too


@pytest.mark.parametrize("env, match", [
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "missing JAX_COORDINATOR_ADDRESS"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, r"not in \[0, 2\)"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "not an integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "host:port"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"}, "missing MASTER_PORT"),
])
def test_bad_environments_are_clear_errors(env, match):
    with pytest.raises(DistributedConfigError, match=match):
        settings_from_env(env)


CHILD = """
import json, sys
sys.path.insert(0, {repo!r})
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from fp8rl_jax.parallel.distributed import initialize_distributed
s = initialize_distributed()
import numpy as np, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from fp8rl_jax.parallel import MeshConfig, make_mesh
mesh = make_mesh(MeshConfig(data=2, fsdp=2))  # all 4 devices of both processes
n = jax.device_count()
x = jax.make_array_from_callback((n, 3), NamedSharding(mesh, P(("data", "fsdp"))),
                                 lambda idx: np.arange(3 * n, dtype=np.float32).reshape(n, 3)[idx])
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
print("RESULT " + json.dumps({{"source": s.source, "pid": jax.process_index(), "procs": jax.process_count(),
                              "devices": n, "local": jax.local_device_count(), "sum": float(total.addressable_data(0))}}))
"""


def test_two_processes_form_one_mesh(tmp_path):
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    procs = []
    for pid in range(2):
        env = cpu_devices_env(2, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                              JAX_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    results = []
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    assert sorted(r["pid"] for r in results) == [0, 1]
    for r in results:
        assert r["source"] == "jax" and r["procs"] == 2 and r["devices"] == 4 and r["local"] == 2
        assert r["sum"] == float(sum(range(12)))  # every process sees the sum over both processes' shards
