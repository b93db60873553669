"""``prefix-router fleetsim``: routing judged on fleets of any size, in virtual time.

``run.py`` holds the loop (replicas, one gateway, clients), ``router.py`` the gateway's routing as
it ships, ``jobs.py`` the requests, ``capacity.py`` the rate a fleet serves under a TTFT
objective, ``cli.py`` the command.
"""
