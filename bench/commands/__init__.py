"""The commands of ``python -m bench``, one module each: ``COMMANDS`` lists them in the order
``--help`` shows, a command's name being its module's with ``-`` for ``_``. A module here that
``COMMANDS`` misses fails ``tests/test_bench_main.py``."""

COMMANDS = ("compare", "overhead", "choice", "fleet-cost", "instances", "mooncake", "load", "hostile-bodies",
            "sim-throughput", "kv-event-sizes", "kv-intake", "fleetsim", "fleetsim-speed", "fleetsim-capacity",
            "fleetsim-knobs", "fleetsim-disagg", "fleetsim-tiers", "data-parallel-vllm")


def module_of(command: str) -> str:
    """The module that runs ``command``: ``hostile-bodies`` -> ``bench.commands.hostile_bodies``."""
    return f"{__name__}.{command.replace('-', '_')}"
