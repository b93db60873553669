"""Small helpers shared by the gateway tests."""

from __future__ import annotations

import random

from router.metrics import sample_sum

MODEL = "sim"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def text(rng: random.Random, n: int) -> str:
    """``n`` words drawn from a small vocabulary (prompt text with no meaning)."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


metric = sample_sum  # (page, name, **labels) -> sum of matching samples
