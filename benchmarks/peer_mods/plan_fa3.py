"""What the peer run of FlashAttention-3's hopper/test_flash_attn.py selects (PEER_SUITE=fa3), as data.

Read by plugin.py, as plan.py for the fa4mods suite. Keys are "file::function". The tests call the top-level
flash_attn_interface (FA3's API, served here by the same kernels as flash_attn and flash_attn.cute); FP8 items
expect the FP8 kernels, which this project refuses with NotImplementedError (classified unsupported).
"""

# Items kept per test function when it has no SAMPLE entry. Functions with fewer items run whole.
DEFAULT_N = 6

# (module, attribute, why): names the upstream module imports that the project may lack (see plan.py).
SHIMS = []

# The big grids (dtypes x head dims x shapes x options: thousands of items each) get a wider sample; issue 32's
# KV-cache, split and combine functions first.
SAMPLE = {
    "test_flash_attn.py::test_flash_attn_output": 24,
    "test_flash_attn.py::test_flash_attn_varlen_output": 24,
    "test_flash_attn.py::test_flash_attn_kvcache": 40,
    "test_flash_attn.py::test_flash_attn_combine": 12,
}

# Whole functions left out, with the reason the summary prints.
DESELECT = {
    "test_flash_attn.py::test_flash_attn_race_condition":
        "allocates a 70 GiB dummy buffer first (sized for an otherwise idle 80 GB GPU): beside the run's other "
        "workers it fails on memory, not on the project",
}
