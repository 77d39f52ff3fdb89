"""Runs an experiment script as ``python SCRIPT ARGS`` would (its ``__main__`` block, its own argument
parsing), with the ``tiny_qwen3`` / ``tiny_qwen3_moe`` presets cut to one decoder layer.

For smoke tests that must start the script in a child process (a device count fixed when JAX starts):
on the CPU their cost is XLA compiling the model's programs, which grows with the depth, and every
layer runs the same code. Usage: ``python tests/_a_one_layer_script.py experiments/X.py ARGS...``.
"""

import dataclasses
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configs.models import PRESETS  # noqa: E402

for _name in ("tiny_qwen3", "tiny_qwen3_moe"):
    PRESETS[_name] = dataclasses.replace(PRESETS[_name], num_layers=1)

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
