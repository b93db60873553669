"""Small helpers shared by the gateway tests."""

from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families

MODEL = "sim"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def text(rng: random.Random, n: int) -> str:
    """``n`` words drawn from a small vocabulary (prompt text with no meaning)."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def metric(page: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``, in a Prometheus page."""
    total = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
