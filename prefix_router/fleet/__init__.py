"""The fleet's state: its replicas and what the gateway knows of each.

``replicas`` (health, load, models, each replica's cache picture), ``discovery`` (replicas from
DNS), ``kv_follower`` (finding and checking each replica's KV event stream), ``breaker`` (circuit
breaking), ``admission`` (queueing when the fleet is full), ``tenants`` (keys, cache salts,
isolation) and ``response_homes`` (which replica stores each Response).
"""
