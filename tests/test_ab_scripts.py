"""The A/B benchmark scripts' pieces that need no GPU (benchmarks/ab_cute_bwd.py, ab_cute_fwd.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import ab_cute_bwd  # noqa: E402


def test_rounds_rotate_the_variant_order():
    """Round r starts at variant r (mod n): over n rounds every variant is timed first once (the first-timed
    one runs on a rested GPU), and each round times every variant once."""
    v = [{}, {"X": "1"}, {"X": "2"}]
    assert [i for i, _ in ab_cute_bwd.round_order(v, 0)] == [0, 1, 2]
    assert [i for i, _ in ab_cute_bwd.round_order(v, 1)] == [1, 2, 0]
    assert [i for i, _ in ab_cute_bwd.round_order(v, 2)] == [2, 0, 1]
    assert [i for i, _ in ab_cute_bwd.round_order(v, 3)] == [0, 1, 2]
    assert sorted(ab_cute_bwd.round_order(v, r)[0][0] for r in range(3)) == [0, 1, 2]
    assert all(var is v[i] for i, var in ab_cute_bwd.round_order(v, 1))


def test_summary_is_the_median_of_the_rounds():
    """One fast first-timed round does not decide a variant's number (the best-of-rounds did)."""
    assert ab_cute_bwd.summary([600.0, 610.0, 700.0]) == 610.0
    assert ab_cute_bwd.summary([500.0]) == 500.0


def test_variants_parse():
    variants, names = ab_cute_bwd.variants(";FLASH_ATTN_CUTE_FWD_PERSISTENT=1,FLASH_ATTN_CUTE_FWD_REVERSE=1")
    assert variants == [{}, {"FLASH_ATTN_CUTE_FWD_PERSISTENT": "1", "FLASH_ATTN_CUTE_FWD_REVERSE": "1"}]
    assert set(names) == {"FLASH_ATTN_CUTE_FWD_PERSISTENT", "FLASH_ATTN_CUTE_FWD_REVERSE"}
