"""Loading and merging the gateway configuration (``prefix_router/config/load.py``): files, CLI
overrides, shorthands, and errors naming the key path, file and line. The value checks:
``test_checks.py``; the schema and the example configurations: ``test_schema.py``.

Error tests assert only that the message starts with the key path (or file path, or line), so
wording can improve without breaking them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefix_router.config import (
    ConfigError,
    GatewayConfig,
    HealthConfig,
    ReplicaConfig,
    RoutingConfig,
    config_from_dict,
    load_config,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def error_for(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return str(info.value)


# --- what loads ----------------------------------------------------------------------------

def test_no_file_gives_the_defaults():
    assert load_config() == GatewayConfig()
    assert load_config().routing.virtual_nodes == 160


def test_an_empty_file_gives_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing set\n")) == GatewayConfig()


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


def test_a_replica_has_one_role_and_prefill_replicas_need_a_decode_pool():
    with pytest.raises(ConfigError, match=r"^replicas\[1\]\.url: .* with role prefill; a replica has one role"):
        config_from_dict({"replicas": [{"url": "http://a:8000", "role": "prefill"},
                                       {"url": "http://a:8000", "role": "decode"}]})
    with pytest.raises(ConfigError, match=r"^replicas\[0\]\.role: prefill replicas need decode replicas"):
        config_from_dict({"replicas": [{"url": "http://a:8000", "role": "prefill"}]})
    with pytest.raises(ConfigError, match=r"^discovery\.prefill_dns: prefill replicas need decode replicas"):
        config_from_dict({"discovery": {"prefill_dns": "vllm-prefill"}})
    assert config_from_dict({"replicas": [{"url": "http://a:8000", "role": "prefill"}],
                             "discovery": {"dns": "vllm"}}).replicas[0].role == "prefill"


def test_replicas_come_from_dns_or_from_the_kubernetes_api_not_both():
    for dns in ({"dns": "vllm"}, {"prefill_dns": "vllm-prefill"}):
        with pytest.raises(ConfigError, match=r"^discovery\.kubernetes\.label_selector: .* not both"):
            config_from_dict({"discovery": {**dns, "kubernetes": {"label_selector": "app=vllm"}}})


def test_every_problem_of_a_file_is_named_each_on_its_own_line(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("routing:\n  load_factr: 2\n  virtual_nodes: 0\nreplicas:\n  - http://a:8000/v1\n"
                    "  - {url: http://b:8000, weight: -1}\nhealth: {interval_s: fast}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert [line.split(": ")[0] for line in lines] == ["replicas[0].url", "replicas[1].weight", "routing.load_factr",
                                                       "routing.virtual_nodes", "health.interval_s"], lines
    out = subprocess.run([sys.executable, "-m", "prefix_router.cli", "serve", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [f"prefix-router serve: {line}" for line in lines]
