"""Loading, merging and validating the gateway configuration (``prefix_router/config.py``).

Error tests assert only that the message starts with the key path (or file path, or line), so
wording can improve without breaking them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from prefix_router.config import checks as config_checks
from prefix_router.config import (
    POLICIES,
    ConfigError,
    GatewayConfig,
    HealthConfig,
    ReplicaConfig,
    RoutingConfig,
    config_from_dict,
    load_config,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
EXAMPLES = sorted(CONFIGS.glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def error_for(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return str(info.value)


def as_plain(value):
    """A config value as YAML would give it: dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value):
        return {f.name: as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [as_plain(v) for v in value]
    return value


# --- what loads ----------------------------------------------------------------------------

def test_no_file_gives_the_defaults():
    assert load_config() == GatewayConfig()
    assert load_config().routing.virtual_nodes == 160


def test_an_empty_file_gives_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing set\n")) == GatewayConfig()


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


def test_the_readme_configuration_table_names_every_key():
    readme = (CONFIGS.parent / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("### Configuration"):readme.index("### How a request is routed")]
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
            assert f"`{path}`" in table, f"README's configuration table lacks {path}"


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


def test_every_range_check_names_a_real_field():
    for cls, name in config_checks.CHECKS:
        assert name in {f.name for f in dataclasses.fields(cls)}, (cls.__name__, name)


def test_overrides_win_over_the_file_and_merge_nested_sections(tmp_path):
    path = write(tmp_path, "host: 10.0.0.1\nreplicas: [http://a:8000]\n"
                           "routing: {virtual_nodes: 100, load_factor: 2}\n")
    config = load_config(path, overrides={"host": "127.0.0.1", "routing": {"virtual_nodes": 50},
                                          "replicas": [{"url": "http://b:8000"}]})
    assert config.host == "127.0.0.1"
    assert config.routing.virtual_nodes == 50
    assert config.routing.load_factor == 2.0  # kept from the file
    assert [r.url for r in config.replicas] == ["http://b:8000"]  # lists are replaced


def test_overrides_apply_without_a_file():
    assert load_config(overrides={"port": 9000}).port == 9000


def test_a_url_string_is_shorthand_for_a_replica_mapping():
    config = config_from_dict({"replicas": ["http://a:8000", {"url": "https://b", "weight": 3}]})
    assert config.replicas == (ReplicaConfig(url="http://a:8000"),
                               ReplicaConfig(url="https://b", weight=3))


@pytest.mark.parametrize("url", ["http://a:8000/", "http://a:8000//"])
def test_trailing_slashes_of_replica_urls_are_dropped(url):
    assert config_from_dict({"replicas": [url]}).replicas[0].url == "http://a:8000"


def test_an_int_is_accepted_where_a_number_is_expected():
    config = config_from_dict({"health": {"interval_s": 3}})
    assert config.health == HealthConfig(interval_s=3.0)
    assert isinstance(config.health.interval_s, float)


def test_null_is_accepted_where_the_field_allows_none():
    assert config_from_dict({"routing": {"block_size": None}}).routing == RoutingConfig()


def test_yaml_anchors_and_merge_keys_work(tmp_path):
    path = write(tmp_path, "replicas:\n  - &r {url: http://a:1, weight: 2}\n"
                           "  - {<<: *r, url: http://b:1}\n")
    assert [(r.url, r.weight) for r in load_config(path).replicas] == [("http://a:1", 2),
                                                                       ("http://b:1", 2)]


def test_every_policy_name_is_accepted():
    for policy in POLICIES:
        assert config_from_dict({"routing": {"policy": policy}}).routing.policy == policy


# --- what is rejected, and where the message points ---------------------------------------

@pytest.mark.parametrize("data, key_path", [
    ({"routing": {"virtual_nodes": "many"}}, "routing.virtual_nodes: expected an integer"),
    ({"port": "8080"}, "port: expected an integer"),
    ({"health": {"timeout_s": "1s"}}, "health.timeout_s: expected a number"),
    ({"log_prompts": "yes"}, "log_prompts: expected true or false"),
    ({"routing": 5}, "routing: expected a mapping"),
    ({"replicas": "http://a:1"}, "replicas: expected a list"),
    ({"replicas": [5]}, "replicas[0]: expected a URL string or a mapping"),
    ({"replicas": [{"url": "http://a:1", "block_size": "16"}]}, "replicas[0].block_size:"),
    ({"host": None}, "host: expected a string"),
])
def test_a_wrong_type_names_the_key_path(data, key_path):
    assert error_for(data).startswith(key_path)


@pytest.mark.parametrize("data, key_path", [
    ({"port": True}, "port:"),
    ({"routing": {"virtual_nodes": False}}, "routing.virtual_nodes:"),
    ({"upstream": {"read_timeout_s": True}}, "upstream.read_timeout_s:"),  # bool is no number
    ({"routing": {"use_user_field": 1}}, "routing.use_user_field:"),  # and 1 is no bool
])
def test_bool_and_int_are_not_interchangeable(data, key_path):
    assert error_for(data).startswith(key_path)


@pytest.mark.parametrize("data, key_path", [
    ({"prot": 80}, "prot: unknown key"),
    ({"routing": {"vitrual_nodes": 3}}, "routing.vitrual_nodes: unknown key"),
    ({"replicas": [{"url": "http://a:1", "wieght": 2}]}, "replicas[0].wieght: unknown key"),
])
def test_an_unknown_key_names_its_path_and_the_valid_keys(data, key_path):
    message = error_for(data)
    assert message.startswith(key_path)
    if key_path.startswith("routing."):
        assert "virtual_nodes" in message  # the valid keys are listed


@pytest.mark.parametrize("data, key_path", [
    ({"routing": {"virtual_nodes": 0}}, "routing.virtual_nodes:"),
    ({"routing": {"load_factor": 0.9}}, "routing.load_factor:"),
    ({"routing": {"branch_threshold": 1}}, "routing.branch_threshold:"),
    ({"health": {"timeout_s": 0}}, "health.timeout_s:"),
    ({"scrape": {"interval_s": -1.0}}, "scrape.interval_s:"),
    ({"upstream": {"max_retries": -1}}, "upstream.max_retries:"),
    ({"limits": {"max_body_bytes": 0}}, "limits.max_body_bytes:"),
    ({"port": 70000}, "port:"),
    ({"replicas": [{"url": "http://a:1", "weight": 0}]}, "replicas[0].weight:"),
    ({"index": {"max_blocks_per_replica": 0}}, "index.max_blocks_per_replica:"),
])
def test_an_out_of_range_value_names_the_key_path(data, key_path):
    assert error_for(data).startswith(key_path)


def test_the_edges_of_the_ranges_are_allowed():
    config = config_from_dict({"routing": {"load_factor": 1}, "upstream": {"max_retries": 0},
                               "port": 0})
    assert (config.routing.load_factor, config.upstream.max_retries, config.port) == (1.0, 0, 0)


def test_an_unknown_policy_names_the_key_and_the_allowed_ones():
    message = error_for({"routing": {"policy": "random"}})
    assert message.startswith("routing.policy:")
    assert all(policy in message for policy in POLICIES)


@pytest.mark.parametrize("url", ["vllm-0:8000", "ftp://a", "http://", "http://a:port",
                                 "http://a:1?x=1", ""])
def test_a_bad_replica_url_names_the_key_path(url):
    data = {"replicas": ["http://ok:1", url]}
    assert error_for(data).startswith("replicas[1].url:")


def test_a_replica_listed_twice_is_an_error():
    assert error_for({"replicas": ["http://a:1/", "http://a:1"]}).startswith("replicas[1].url:")


def test_a_replica_needs_a_url():
    assert error_for({"replicas": [{"weight": 2}]}).startswith("replicas[0].url:")


def test_a_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(path)


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "host: 127.0.0.1\nrouting:\n  policy: [round-robin\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(str(path))
    assert "line " in str(info.value)


def test_a_duplicate_yaml_key_is_an_error_with_its_line(tmp_path):
    path = write(tmp_path, "routing: {virtual_nodes: 10}\nport: 1\nrouting: {load_factor: 2}\n")
    with pytest.raises(ConfigError, match=r"line 3"):
        load_config(path)


def test_a_file_that_is_not_a_mapping_is_named(tmp_path):
    path = write(tmp_path, "- http://a:1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(str(path))


def test_an_error_from_a_file_names_the_nested_key(tmp_path):
    path = write(tmp_path, "routing:\n  virtual_nodes: many\n")
    with pytest.raises(ConfigError, match=r"^routing\.virtual_nodes:"):
        load_config(path)


def test_a_removed_setting_names_what_replaced_it():
    with pytest.raises(ConfigError, match=r"routing\.spill_queue_depth: no longer a setting; .*routing\.load_factor"):
        config_from_dict({"routing": {"spill_queue_depth": 8}})
