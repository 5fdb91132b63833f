"""What the peer run of FlashAttention-4's score_mod / mask_mod / block-sparsity tests selects, as data.

Read by plugin.py. Keys of SAMPLE and DESELECT are "file::function" (the upstream test file's name and the test
function's name, without parameters).
"""

# Items kept per test function when it has no SAMPLE entry. Functions with fewer items run whole.
DEFAULT_N = 6

# (module, attribute, why): names the upstream test modules import at module level that this package may lack.
# Where the real module lacks the name, plugin.py installs a stand-in that raises PeerMissing when called, so the
# test module still imports and only the tests that use the name are lost (classified missing_api).
# A name the project really has is never shadowed, and a module that does not exist is never faked.
_FA4_INTERNAL = "FA4 internals of its SM100 backward scheduling / SM90 tile-size choice, not this package's API"
SHIMS = [
    ("flash_attn.cute.block_sparsity", "block_sparse_bwd_supports_2cta", _FA4_INTERNAL),
    ("flash_attn.cute.block_sparsity", "get_kv_subtile_factor", _FA4_INTERNAL),
    ("flash_attn.cute.block_sparsity", "normalize_block_sparse_config_bwd", _FA4_INTERNAL),
    ("flash_attn.cute.block_sparsity", "compute_dq_write_order", _FA4_INTERNAL),
    ("flash_attn.cute.block_sparsity", "compute_dq_write_order_from_block_mask", _FA4_INTERNAL),
    ("flash_attn.cute.interface", "_tile_size_bwd_sm90", _FA4_INTERNAL),
    ("flash_attn.cute.interface", "normalize_block_sparse_config_bwd", _FA4_INTERNAL),
]

# Items kept per function (times PEER_SCALE). The big parametrized grids (hundreds to thousands of items: masks x
# shapes x dtypes) get 12, a wider sample of their values; everything else gets DEFAULT_N. At scale 1 this selects
# about 380 items, which 4 workers on one Hopper GPU should get through within the default budget.
_BIG = 12
SAMPLE = {
    # test_score_mod.py
    "test_score_mod.py::test_cute_vs_flex_attention": _BIG,
    "test_score_mod.py::test_cute_vs_flex_attention_with_aux_tensors": _BIG,
    "test_score_mod.py::test_cute_vs_flex_attention_backward": _BIG,
    # test_mask_mod.py
    "test_mask_mod.py::test_static_masks": _BIG,
    "test_mask_mod.py::test_parameterized_masks": _BIG,
    # test_score_mod_varlen.py
    "test_score_mod_varlen.py::test_varlen_with_score_mod": _BIG,
    "test_score_mod_varlen.py::test_varlen_with_score_mod_vectorized": _BIG,
    "test_score_mod_varlen.py::test_varlen_with_global_idx_score_mod": _BIG,
    "test_score_mod_varlen.py::test_varlen_score_mod_kvcache": _BIG,
    "test_score_mod_varlen.py::test_varlen_score_mod_with_paged_kvcache_global": _BIG,
    "test_score_mod_varlen.py::test_varlen_score_mod_backward": _BIG,
    "test_score_mod_varlen.py::test_varlen_score_mod_backward_with_global": _BIG,
    # test_mask_mod_varlen.py
    "test_mask_mod_varlen.py::test_varlen_static_masks": _BIG,
    "test_mask_mod_varlen.py::test_varlen_parameterized_masks": _BIG,
    "test_mask_mod_varlen.py::test_varlen_global_masks": _BIG,
    "test_mask_mod_varlen.py::test_varlen_mask_mod_vectorized": _BIG,
    "test_mask_mod_varlen.py::test_varlen_block_sparse": _BIG,
    "test_mask_mod_varlen.py::test_varlen_block_sparse_splitkv_matches_unsplit": _BIG,
    # test_block_sparsity.py (host-side block-mask construction: cheap items)
    "test_block_sparsity.py::test_fixed_length_masks": _BIG,
    "test_block_sparsity.py::test_parameterized_masks": _BIG,
    "test_block_sparsity.py::test_varlen": _BIG,
    "test_block_sparsity.py::test_varlen_parameterized_masks": _BIG,
}

# Whole functions left out, with the reason the summary prints.
_NOT_OUR_API = "tests FA4's internal SM100 dQ write-order / 2-CTA / SM90 tile-size helpers, not an API of flash_attn.cute"
DESELECT = {
    "test_mask_mod.py::test_sm100_block_sparse_bwd_kv_subtile_selects_cta_policy": _NOT_OUR_API,
    "test_mask_mod.py::test_sm100_block_sparse_bwd_kv_subtile_rejects_non_multiple": _NOT_OUR_API,
    "test_mask_mod.py::test_block_sparse_bwd_normalize_accepts_odd_kv_subtile_for_1cta": _NOT_OUR_API,
    "test_mask_mod.py::test_dq_write_order_static_masks": _NOT_OUR_API,
    "test_mask_mod.py::test_dq_write_order_parameterized_masks": _NOT_OUR_API,
    "test_mask_mod.py::test_dq_write_order_document_mask": _NOT_OUR_API,
    "test_score_mod.py::test_sm90_block_sparse_score_mod_backward_with_dq_swapab": _NOT_OUR_API,
}
