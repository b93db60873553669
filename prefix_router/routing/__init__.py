"""The routing choice: which replica gets a request, from its block hashes and the fleet's load.

``policy`` holds the prefix-affinity rule and the ``Policy`` protocol every rule follows;
``baselines`` the rules it is judged against; ``bounds`` the load bound; ``ring`` the
consistent-hash ring new prefixes are placed by; ``prefix_stats`` what the gateway learns about
prefixes shared by many requests. Pure: no HTTP, no event loop (``tests/test_layout.py``).
"""
