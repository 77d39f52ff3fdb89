"""The runner's suites, by name. A suite module defines:

- ``add_arguments(parser)``: its command-line flags;
- ``run(args) -> dict``: measures and returns the JSON-able payload;
- ``result_name(args) -> str`` (optional): the result file's name, default the suite's name;
- ``SMOKE``: the flags of a tiny CPU run (the CI smoke suite runs each suite with them).
"""

SUITES: dict[str, str] = {}
