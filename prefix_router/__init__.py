"""prefix-router: a prefix-aware gateway for fleets of vLLM replicas with automatic prefix caching.

The runtime, by concept: ``serve`` (the HTTP layer), ``routing`` (the choice), ``cache`` (the
picture of each replica's prefix cache), ``prompts`` (prompt analysis), ``fleet`` (replicas and
what is known of them), ``misses`` (why a request missed) and ``epp`` (the Envoy Endpoint Picker);
``gateway`` holds one process's long-lived state, ``app`` builds the aiohttp application, ``cli``
the ``prefix-router`` command. ``tools`` ships beside the runtime and is never on its request path.
"""
