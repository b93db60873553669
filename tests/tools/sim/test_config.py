"""A simulated replica's settings (``prefix_router/tools/sim/config.py``): each field out of range
refused by name, and the modelled duration of an engine step."""

from __future__ import annotations

import pytest

from prefix_router.tools.sim.config import SimConfig


@pytest.mark.parametrize("field, value", [
    ("block_size", 0), ("max_num_seqs", 0), ("max_num_batched_tokens", -1), ("max_model_len", 0),
    ("prefill_tokens_per_s", 0.0), ("time_scale", 0.0), ("default_max_tokens", 0),
    ("decode_ms_per_token", -0.1), ("kv_read_ns_per_token", -1.0), ("num_gpu_blocks", 1),
])
def test_a_field_out_of_range_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SimConfig(**{field: value}).validate()


def test_the_defaults_and_the_edges_of_the_ranges_are_valid():
    assert SimConfig().validate() == SimConfig()
    SimConfig(num_gpu_blocks=2, decode_ms_per_token=0.0, kv_read_ns_per_token=0.0).validate()


def test_a_step_costs_its_fixed_part_its_prefill_and_reading_the_decoding_context():
    config = SimConfig(decode_ms_per_token=6.0, prefill_tokens_per_s=25_000.0, kv_read_ns_per_token=40.0)
    assert config.step_seconds(0, 0) == pytest.approx(0.006)
    assert config.step_seconds(25_000, 0) == pytest.approx(1.006)  # a second of prefill
    assert config.step_seconds(0, 1_000_000) == pytest.approx(0.046)  # 40 ns for each of a million tokens
