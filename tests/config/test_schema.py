"""The configuration's schema (``prefix_router/config/schema.py``): the example configurations in
``configs/`` load and show the defaults, every key is documented, every default and policy name
goes through the loader."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from prefix_router.config import POLICIES, GatewayConfig, ReplicaConfig, config_from_dict, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXAMPLES = sorted(CONFIGS.glob("*.yaml"))


def as_plain(value):
    """A config value as YAML would give it: dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value):
        return {f.name: as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [as_plain(v) for v in value]
    return value


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_config_loads(path):
    config = load_config(path)
    assert config.replicas, "an example without replicas shows nothing"


def test_the_examples_folder_is_not_empty():
    assert {"gateway.yaml", "local-sim.yaml", "round-robin.yaml"} <= {p.name for p in EXAMPLES}


def test_the_main_example_shows_every_key_at_its_default():
    """gateway.yaml documents every key; its values must stay the code's defaults."""
    raw = yaml.safe_load((CONFIGS / "gateway.yaml").read_text(encoding="utf-8"))
    config = load_config(CONFIGS / "gateway.yaml")
    defaults = GatewayConfig()
    for f in dataclasses.fields(GatewayConfig):
        assert f.name in raw, f"gateway.yaml lacks {f.name}"
        if f.name == "replicas":
            continue
        assert getattr(config, f.name) == getattr(defaults, f.name), f.name
        if dataclasses.is_dataclass(getattr(defaults, f.name)):
            assert set(raw[f.name]) == {g.name for g in dataclasses.fields(getattr(defaults, f.name))}
    assert set(raw["replicas"][0]) == {f.name for f in dataclasses.fields(ReplicaConfig)}
    assert [r.url for r in config.replicas] == [f"http://vllm-{i}:8000" for i in range(3)]


def test_the_configuration_reference_names_every_key():
    """The table the README held is docs/configuration.md's reference now."""
    page = (CONFIGS.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    table = page[page.index("## Reference"):]
    defaults = GatewayConfig()
    for f in dataclasses.fields(GatewayConfig):
        value = getattr(defaults, f.name)
        if f.name == "replicas":
            paths = [f"replicas[].{g.name}" for g in dataclasses.fields(ReplicaConfig)]
        elif dataclasses.is_dataclass(value):
            paths = [f"{f.name}.{g.name}" for g in dataclasses.fields(value)]
        else:
            paths = [f.name]
        for path in paths:
            # a list of sections (auth.tenants) has a section of its own: auth.tenants[]
            assert f"`{path}`" in table or f"`{path}[]`" in table, f"docs/configuration.md's reference lacks {path}"


def test_the_baseline_differs_from_local_sim_only_in_policy():
    local = load_config(CONFIGS / "local-sim.yaml")
    baseline = load_config(CONFIGS / "round-robin.yaml")
    assert local.routing.policy == "prefix-affinity"
    assert baseline.routing.policy == "round-robin"
    assert baseline == dataclasses.replace(local, routing=baseline.routing)
    assert [r.url for r in local.replicas] == [f"http://127.0.0.1:{p}" for p in range(8001, 8005)]
    assert local.tokenizer is None


def test_every_default_round_trips_through_the_loader():
    """Exercises every field's annotation, so an unsupported new type fails here."""
    full = GatewayConfig(replicas=(ReplicaConfig(url="http://a:1", block_size=16, num_gpu_blocks=9),))
    assert config_from_dict(as_plain(full)) == full
    assert config_from_dict(as_plain(GatewayConfig())) == GatewayConfig()


def test_every_policy_name_is_accepted():
    for policy in POLICIES:
        assert config_from_dict({"routing": {"policy": policy}}).routing.policy == policy
