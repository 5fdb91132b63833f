"""The A/B benchmark scripts' pieces that need no GPU (benchmarks/attention/ab_cute_bwd.py, ab_cute_fwd.py)."""
from benchmarks.attention import ab_cute_bwd


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
    # (a value may hold "=": FLASH_ATTN_CUTE_OVERRIDES' field=value)
    variants, names = ab_cute_bwd.variants(";FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=1,FLASH_ATTN_CUTE_DISABLE=split")
    assert variants == [{}, {"FLASH_ATTN_CUTE_OVERRIDES": "fwd.persistent=1", "FLASH_ATTN_CUTE_DISABLE": "split"}]
    assert set(names) == {"FLASH_ATTN_CUTE_OVERRIDES", "FLASH_ATTN_CUTE_DISABLE"}


def test_variant_values_keep_their_own_lists_and_switch_the_settings(cute_env, monkeypatch):
    """FLASH_ATTN_CUTE_OVERRIDES / _DISABLE hold comma-separated lists: the items after NAME=VALUE that are not
    NAME=VALUE themselves belong to that value. Triton's variables are read at import only: refused. apply()
    has flash_attn.cute read the environment again."""
    import pytest

    from flash_attn.cute import config, settings

    spec = "FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=1,fwd.tma_o=1,FLASH_ATTN_CUTE_DISABLE=pack_gqa,split;"
    variants, names = ab_cute_bwd.variants(spec)
    assert variants == [{"FLASH_ATTN_CUTE_OVERRIDES": "fwd.persistent=1,fwd.tma_o=1",
                         "FLASH_ATTN_CUTE_DISABLE": "pack_gqa,split"}, {}]
    for bad in ("fwd.persistent=1", "FLASH_ATTN_TRITON_OVERRIDES=fwd_variant=ws"):
        with pytest.raises(ValueError):
            ab_cute_bwd.variants(bad)
    for n in names:  # (recorded, so that the test's end restores them whatever apply() left)
        monkeypatch.setenv(n, "")
    ab_cute_bwd.apply(variants[0], names)
    assert config.overrides("fwd") == {"persistent": True, "tma_o": True}
    assert settings.disabled("pack_gqa") and settings.disabled("split")
    ab_cute_bwd.apply(variants[1], names)
    assert config.overrides("fwd") == {} and not settings.disabled("split")


def test_decode_ab_parses_shapes_and_variants():
    from benchmarks.attention import ab_cute_decode as ad
    import pytest

    assert ad.parse_shapes("1:1:8192:32:8:128, 4:16:8192:32:4:64") == [(1, 1, 8192, 32, 8, 128),
                                                                         (4, 16, 8192, 32, 4, 64)]
    assert len(ad.parse_shapes(ad.DEFAULT_SHAPES)) == 8
    for bad, msg in [("1:1:8192:32:8", "B:Sq:Sk:H:Hk:D"), ("1:1:8:6:4:64", "multiple of Hk")]:
        with pytest.raises(ValueError, match=msg):
            ad.parse_shapes(bad)
    variants, names = ad.parse_variants("plain:pack_gqa=False;both:pack_gqa=True,num_splits=0,FLASH_ATTN_CUTE_X=1;"
                                        "pack_gqa=None;")
    assert variants == [("plain", {"pack_gqa": False}, {}),
                        ("both", {"pack_gqa": True, "num_splits": 0}, {"FLASH_ATTN_CUTE_X": "1"}),
                        ("pack_gqa=None", {"pack_gqa": None}, {}), ("default", {}, {})]
    assert names == ["FLASH_ATTN_CUTE_X"]
    variants, names = ad.parse_variants("o:FLASH_ATTN_CUTE_OVERRIDES=fwd.stages=2,fwd.block_n=96,num_splits=0;"
                                        "d:FLASH_ATTN_CUTE_DISABLE=split,pack_gqa,pack_gqa=False")
    assert variants == [("o", {"num_splits": 0}, {"FLASH_ATTN_CUTE_OVERRIDES": "fwd.stages=2,fwd.block_n=96"}),
                        ("d", {"pack_gqa": False}, {"FLASH_ATTN_CUTE_DISABLE": "split,pack_gqa"})]
    for bad in ("x:pack_gqa=maybe", "x:num_splits=two", "x:pack_gqa"):
        with pytest.raises(ValueError):
            ad.parse_variants(bad)
    assert ad.kv_bytes(2, 1000, 8, 128) == 2 * 1000 * 8 * 256 * 2
    assert ad.kv_bytes(1, 10, 1, 192, 128) == 10 * 320 * 2


def test_decode_ab_finds_the_kernels_its_calls_ask_for(cute_env):
    """--compile-only's list: the calls of every shape and variant on CPU tensors, fwd_kernel recording; the four
    variants ask for the plain, packed, split and packed split kernels (dense and paged varlen), and the module's
    functions are restored after."""
    import pytest

    pytest.importorskip("cutlass.cute")
    from benchmarks.attention import ab_cute_decode as ad
    import torch

    from flash_attn.cute import interface, kernels, launch, plan

    # (cute_env: no FLASH_ATTN_CUTE_DISABLE: pack_gqa, split and paged on)
    def state():  # what the script replaces while it records, where the calls use it
        return launch.fwd_kernel, interface._device_arch, plan._device_sms, kernels._kernels, dict(kernels._kernels)

    before = state()
    variants, names = ad.parse_variants("plain:pack_gqa=False;pack:pack_gqa=True;split:pack_gqa=False,num_splits=0;"
                                        "both:pack_gqa=True,num_splits=0")
    for paged, extra in [(0, {}), (16, {"varlen": True, "paged": 16})]:
        asked = ad.kernels_asked([(1, 1, 2048, 8, 2, 64)], variants, names, paged, True)
        got = [{k: v for k, v in kw.items() if v and not (k == "pack" and v == 1)} for _, _, _, kw in asked]
        assert got == [extra, {**extra, "pack": 4}, {**extra, "split": True}, {**extra, "pack": 4, "split": True}]
        assert all(a[:3] == (torch.bfloat16, 64, True) for a in asked)
    assert state() == before and interface._kernels is launch._kernels is kernels._kernels


def test_varlen_lengths_keep_the_tokens():
    """ab_cute_bwd --varlen: b sequences alternating 3/4 and 5/4 of s (a last odd one s), b * s tokens in all."""
    assert ab_cute_bwd.varlen_lengths(4, 2048) == [1536, 2560, 1536, 2560]
    assert ab_cute_bwd.varlen_lengths(3, 1000) == [750, 1250, 1000]
    assert ab_cute_bwd.varlen_lengths(1, 16384) == [16384]
    for b, s in ((8, 2048), (2, 8192), (5, 999)):
        assert sum(ab_cute_bwd.varlen_lengths(b, s)) == b * s
