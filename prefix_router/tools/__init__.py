"""The tools that ship beside the gateway, never on its request path: the simulated replica
(``sim``), the replay client (``replay``), the demo, the cache audit and the CI gate (the
``prefix-router`` commands of those names), the process launcher the demo, benchmarks and
tests start replicas and gateways with (``launch``), and the tiny model builder (``tiny_model``).

The gateway's runtime modules (``prefix_router/`` outside ``tools/``) import nothing from here, except the command
line (``prefix_router/cli.py``), which dispatches to these commands.
"""
