"""The A/B benchmark scripts' pieces that need no GPU (benchmarks/ab_cute_bwd.py, ab_cute_fwd.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import ab_cute_bwd  # noqa: E402


def test_rounds_alternate_the_variant_order():
    """Round 0 times the variants in order, round 1 in reverse (ABBA), so every variant is timed first once
    in two rounds."""
    v = [{}, {"X": "1"}, {"X": "2"}]
    assert [i for i, _ in ab_cute_bwd.round_order(v, 0)] == [0, 1, 2]
    assert [i for i, _ in ab_cute_bwd.round_order(v, 1)] == [2, 1, 0]
    assert [i for i, _ in ab_cute_bwd.round_order(v, 2)] == [0, 1, 2]
    assert all(var is v[i] for i, var in ab_cute_bwd.round_order(v, 1))


def test_variants_parse():
    variants, names = ab_cute_bwd.variants(";FLASH_ATTN_CUTE_FWD_PERSISTENT=1,FLASH_ATTN_CUTE_FWD_REVERSE=1")
    assert variants == [{}, {"FLASH_ATTN_CUTE_FWD_PERSISTENT": "1", "FLASH_ATTN_CUTE_FWD_REVERSE": "1"}]
    assert set(names) == {"FLASH_ATTN_CUTE_FWD_PERSISTENT", "FLASH_ATTN_CUTE_FWD_REVERSE"}
