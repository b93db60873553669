"""Gateway configuration: the schema (``schema.py``: one frozen dataclass per component) and
its loader (``load.py``: YAML, CLI overrides, every value checked once, errors naming the key).
"""

from prefix_router.config.load import config_from_dict, load_config
from prefix_router.config.schema import (POLICIES, AdmissionConfig, AuthConfig, BreakerConfig, ChangesConfig, ConfigError, DisaggregationConfig,
                     DiscoveryConfig,
                     GatewayConfig, HealthConfig, IndexConfig, KubernetesConfig, KvEventsConfig, LimitsConfig, ReplicaConfig,
                     RoutingConfig, ScrapeConfig, TenantConfig, UpstreamConfig)

__all__ = ["POLICIES", "ConfigError", "ReplicaConfig", "RoutingConfig", "IndexConfig", "HealthConfig",
           "ScrapeConfig", "UpstreamConfig", "LimitsConfig", "DisaggregationConfig", "DiscoveryConfig", "KubernetesConfig", "KvEventsConfig", "BreakerConfig",
           "AdmissionConfig", "ChangesConfig", "TenantConfig", "AuthConfig", "GatewayConfig",
           "load_config", "config_from_dict"]
