"""The benchmark runner: ``python -m experiments.bench SUITE [suite flags]``.

Each suite (``experiments/bench/suites/<name>.py``) measures one thing and returns a JSON-able
payload; the runner adds where and when it ran (device, versions, commit, date) and writes it to
``experiments/results/<device>/<result name>.json``, replacing the last result (git keeps history).
``python -m experiments.bench --list`` names the suites; ``--plan h100`` / ``--plan h200`` runs every
suite behind a published number, sized for that GPU's memory.
"""
