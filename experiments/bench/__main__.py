"""``python -m experiments.bench SUITE [--out-dir DIR] [--no-write] [suite flags]``: runs one suite and
writes its result (`experiments.bench.record.write_result`); ``--list`` names the suites."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from experiments.bench.record import write_result
from experiments.bench.suites import SUITES


def load_suite(name: str):
    """The suite module called ``name``; ValueError naming the suites if there is none."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; suites: {', '.join(sorted(SUITES))}")
    return importlib.import_module(SUITES[name])


def run_suite(name: str, argv: list[str], out_dir=None, write: bool = True) -> dict:
    """Runs suite ``name`` with its flags ``argv``; writes the result unless ``write`` is False."""
    suite = load_suite(name)
    parser = argparse.ArgumentParser(prog=f"python -m experiments.bench {name}", description=suite.__doc__)
    suite.add_arguments(parser)
    args = parser.parse_args(argv)
    payload = suite.run(args)
    if write:
        result = getattr(suite, "result_name", lambda a: name)(args)
        print(f"wrote {write_result(result, payload, out_dir)}")
    return payload


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__)
    parser.add_argument("suite", nargs="?", help="the suite to run (--list names them)")
    parser.add_argument("--list", action="store_true", help="name the suites and exit")
    parser.add_argument("--out-dir", default=None, help="results root (default experiments/results)")
    parser.add_argument("--no-write", action="store_true", help="print the payload, write no file")
    args, rest = parser.parse_known_args(argv)
    if args.list or not args.suite:
        for name in sorted(SUITES):
            print(f"{name:16s} {(load_suite(name).__doc__ or '').strip().splitlines()[0]}")
        return 0
    try:
        payload = run_suite(args.suite, rest, args.out_dir, write=not args.no_write)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.no_write:
        print(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
