"""``python -m experiments.bench SUITE [--out-dir DIR] [--no-write] [--name NAME] [suite flags]``: runs one
suite and writes its result (`experiments.bench.record.write_result`); ``--list`` names the suites;
``--plan h100|h200`` runs (``--step NAME``: one step of; ``--list``: names the steps of) a GPU's plan
(`experiments.bench.plans`)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

import jax

from experiments.bench import plans
from experiments.bench.record import device_slug, write_result
from experiments.bench.suites import SUITES


PLAN_ENV = "FP8RL_BENCH_PLAN"  # set by run_plan for its steps: the GPU kind the plan is sized for


def load_suite(name: str):
    """The suite module called ``name``; ValueError naming the suites if there is none."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; suites: {', '.join(sorted(SUITES))}")
    return importlib.import_module(SUITES[name])


def suite_parser(name: str) -> argparse.ArgumentParser:
    """The command-line parser of suite ``name``'s flags."""
    suite = load_suite(name)
    parser = argparse.ArgumentParser(prog=f"python -m experiments.bench {name}", description=suite.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    suite.add_arguments(parser)
    return parser


def run_suite(name: str, argv: list[str], out_dir=None, write: bool = True, result: str | None = None) -> dict:
    """Runs suite ``name`` with its flags ``argv``; writes the result (as ``result``, default the suite's
    ``result_name``) unless ``write`` is False. A suite's optional ``process_env(args)`` sets environment
    variables first (they must precede JAX's backend start, e.g. vLLM's memory split). A suite without a
    CPU smoke run (``SMOKE = None``) needs a GPU: ValueError on another backend."""
    suite = load_suite(name)
    args = suite_parser(name).parse_args(argv)
    os.environ.update(getattr(suite, "process_env", lambda a: {})(args))
    if getattr(suite, "SMOKE", None) is None and jax.default_backend() != "gpu":
        raise ValueError(f"suite {name} needs a GPU; the backend here is {jax.default_backend()}")
    payload = suite.run(args)
    plan = os.environ.get(PLAN_ENV)
    if plan and jax.default_backend() == "gpu" and device_slug() != plan:
        print(f"warning: a step of the {plan} plan ran on {jax.devices()[0].device_kind}: its sizes are the "
              f"{plan}'s; the result goes to the {device_slug()} folder", file=sys.stderr)
    if write:
        result = result or getattr(suite, "result_name", lambda a: name)(args)
        print(f"wrote {write_result(result, payload, out_dir)}")
    return payload


def run_plan(gpu: str, step: str | None, list_only: bool, out_dir=None) -> int:
    """Runs every step of the plan for ``gpu`` (or only ``step``), each in a process of its own (a fresh
    device and environment per step); ``list_only`` prints the steps instead. Returns the number of
    failed steps (0: all ran)."""
    steps = plans.plan(gpu)
    if list_only:
        for s in steps:
            print(f"{s.name:32s} {s.command()}")
        return 0
    chosen = [s for s in steps if step in (None, s.name)]
    if not chosen:
        raise ValueError(f"plan {gpu} has no step {step!r}; steps: {', '.join(s.name for s in steps)}")
    failed = []
    for s in chosen:
        print(f"== {s.name}: {s.command()}", flush=True)
        out = ["--out-dir", str(out_dir)] if out_dir is not None else []
        rc = subprocess.run([sys.executable, "-m", "experiments.bench", s.suite, *s.flags, "--name", s.name, *out],
                            env={**os.environ, PLAN_ENV: gpu}, check=False).returncode
        if rc:
            failed.append(s.name)
            print(f"== {s.name} failed (exit {rc})", flush=True)
    if failed:
        print(f"failed steps: {' '.join(failed)}", file=sys.stderr)
    return min(len(failed), 1)


# JAX's memory defaults for a benchmark process: allocate as needed, up to nearly all of the GPU (the suites size
# their pools themselves, e.g. a KV pool of vLLM's size beside the weights); a suite's process_env overrides them.
MEMORY_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for k, v in MEMORY_ENV.items():  # before JAX starts its backend (no effect on one already started)
        os.environ.setdefault(k, v)
    parser = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__, allow_abbrev=False,
                                     add_help=False)
    parser.add_argument("-h", "--help", action="store_true", help="this help, or after a suite name the suite's flags")
    parser.add_argument("suite", nargs="?", help="the suite to run (--list names them)")
    parser.add_argument("--list", action="store_true", help="name the suites (with --plan: the plan's steps) and exit")
    parser.add_argument("--plan", choices=sorted(plans.PLANS), default=None,
                        help="run every suite behind a published number, sized for this GPU")
    parser.add_argument("--step", default=None, help="with --plan: run only this step")
    parser.add_argument("--out-dir", default=None, help="results root (default experiments/results)")
    parser.add_argument("--no-write", action="store_true", help="print the payload, write no file")
    parser.add_argument("--name", default=None, help="the result file's name (default: the suite's)")
    args, rest = parser.parse_known_args(argv)
    if args.help:
        if args.suite in SUITES:
            suite_parser(args.suite).print_help()
        else:
            parser.print_help()
        return 0
    try:
        if args.plan:
            if args.suite or rest:
                raise ValueError("--plan takes no suite or suite flags")
            return run_plan(args.plan, args.step, args.list, args.out_dir)
        if args.list or not args.suite:
            for name in sorted(SUITES):
                print(f"{name:16s} {(load_suite(name).__doc__ or '').strip().splitlines()[0]}")
            return 0
        payload = run_suite(args.suite, rest, args.out_dir, write=not args.no_write, result=args.name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.no_write:
        print(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
