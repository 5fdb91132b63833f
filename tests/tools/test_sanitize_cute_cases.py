"""benchmarks/tools/sanitize_cute.py's cases (run under compute-sanitizer on a GPU) cover every kind of forward kernel
the default selection runs, and its prediction of which kernel a case runs agrees with the dispatch (CPU: the
in-memory kernel table stubbed, the calls' tensors on the CPU)."""
import os
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

from benchmarks.tools import sanitize_cute  # noqa: E402
from flash_attn.cute import config, interface, kernels, launch  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cute"))
from _cute_table import swap_kernels  # noqa: E402  (tests/cute's helper: on the path when this file runs alone too)


@pytest.fixture(autouse=True)
def _defaults(cute_env):
    """No FLASH_ATTN_CUTE_OVERRIDES / FLASH_ATTN_CUTE_DISABLE: every kernel on, as run_gpu.sh runs the cases."""


def test_cases_cover_every_kernel_kind():
    configs = {name: sanitize_cute.expected_config(case)[0] for name, case in sanitize_cute.CASES.items()}
    kinds = {
        "persistent, own O buffer (short keys)": lambda c: c.get("persistent") and c.get("tma_o"),
        "persistent, 3 warpgroups": lambda c: c.get("persistent") and c.get("warpgroups") == 3,
        "persistent causal, 2 warpgroups": lambda c: c.get("persistent") and c["causal"] and "warpgroups" not in c,
        "one-tile, 3 warpgroups (long keys)": lambda c: not c.get("persistent") and c.get("warpgroups") == 3,
        "one-tile TMA O, lpt": lambda c: not c.get("persistent") and c.get("tma_o") and c.get("lpt"),
        "one-tile TMA O causal, former order": lambda c: (not c.get("persistent") and c.get("tma_o") and c["causal"]
                                                          and not c.get("lpt")),
        "one-tile direct O store": lambda c: not c.get("persistent") and not c.get("tma_o"),
        "varlen": lambda c: c.get("varlen"), "sink": lambda c: c.get("sink"), "window": lambda c: c["local"],
        "softcap": lambda c: c["softcap"],
        "pack_gqa": lambda c: c.get("pack_gqa") and not c.get("varlen"),
        "pack_gqa varlen": lambda c: c.get("pack_gqa") and c.get("varlen"),
        "v's head dim != q's": lambda c: c.get("head_dim_v"),
        "paged, boxes of a page": lambda c: c.get("paged") and c["paged"] < c.get("block_n", 128),
        "paged, one box of a page": lambda c: c.get("paged") and c["paged"] == c.get("block_n", 128),
        "split-KV": lambda c: c.get("split") and not c.get("varlen"),
        "split-KV varlen, paged": lambda c: c.get("split") and c.get("varlen") and c.get("paged"),
    }
    for kind, test in kinds.items():
        assert any(test(c) for c in configs.values()), kind
    assert {c["head_dim"] for c in configs.values()} == set(config.SUPPORTED_HEAD_DIMS)
    assert {c["dtype"] for c in configs.values()} == {"bf16", "fp16"}
    assert len(set(map(str, configs.values()))) == len(configs)  # no two cases run the same kernel


@pytest.mark.parametrize("name", list(sanitize_cute.CASES))
@pytest.mark.parametrize("packed", ["0", "1"])
def test_prediction_matches_the_dispatch(cute_env, monkeypatch, name, packed):
    # the pack_gqa and split cases: packed / split or not, predicted
    cute_env(DISABLE=None if packed == "1" else "pack_gqa,split")
    dt, d, b, sq, sk, h, hk, opt = sanitize_cute.CASES[name]
    _, key = sanitize_cute.expected_config(sanitize_cute.CASES[name])
    ran = []
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    swap_kernels(monkeypatch, {key: lambda *a: ran.append(key)})  # the in-memory table: the predicted kernel only

    def other(*a, **kw):
        raise AssertionError(f"{name}: dispatched to another kernel ({a}, {kw}), predicted {key}")

    monkeypatch.setattr(launch, "fwd_kernel", other)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    kw = {o: x for o, x in opt.items() if o in ("causal", "window_size", "softcap", "pack_gqa", "num_splits")}
    sink = torch.zeros(h) if opt.get("sink") else None
    if "varlen" in opt:  # the sequences' rows and keys packed, or the keys in pages of opt["paged"] rows
        lens = opt["varlen"]
        cu = lambda n: torch.tensor([0] + n).cumsum(0).to(torch.int32)  # noqa: E731
        q = torch.randn(sum(a for a, _ in lens), h, d, dtype=dtype)
        tk = sum(c for _, c in lens)
        k, v = torch.randn(tk, hk, d, dtype=dtype), torch.randn(tk, hk, opt.get("dv", d), dtype=dtype)
        keys = dict(cu_seqlens_k=cu([c for _, c in lens]))
        if opt.get("paged"):
            page, pages = opt["paged"], [-(-c // opt["paged"]) for _, c in lens]
            k = torch.randn(sum(pages) + 1, page, hk, d, dtype=dtype)
            v = torch.randn(sum(pages) + 1, page, hk, opt.get("dv", d), dtype=dtype)
            table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
            keys = dict(page_table=table, seqused_k=torch.tensor([c for _, c in lens], dtype=torch.int32))
        interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu([a for a, _ in lens]), learnable_sink=sink, **keys, **kw)
    else:
        q = torch.randn(b, sq, h, d, dtype=dtype)
        k, v = torch.randn(b, sk, hk, d, dtype=dtype), torch.randn(b, sk, hk, opt.get("dv", d), dtype=dtype)
        interface.flash_attn_func(q, k, v, learnable_sink=sink, **kw)
    assert ran == [key]


def test_unknown_case_is_an_error(capsys):
    with pytest.raises(SystemExit):
        sanitize_cute.main(["--only", "no_such_case"])
    assert "no_such_case" in capsys.readouterr().err
    assert sanitize_cute.main(["--list", "--only", "d64_causal_long_3wg"]) == 0
    assert "'warpgroups': 3" in capsys.readouterr().out


def test_compile_only_fills_the_disk_cache(cute_env, monkeypatch, tmp_path, capsys):
    """--compile-only builds a case's kernel (the one the selection picks: here the long-key one) into the cache."""
    if not kernels._tvm_ffi():
        pytest.skip("the disk cache needs apache-tvm-ffi")
    cute_env(CACHE=str(tmp_path))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert sanitize_cute.main(["--compile-only", "--only", "d64_causal_long_3wg"]) == 0
    assert "d64_causal_long_3wg: compiled" in capsys.readouterr().out
    assert kernels.disk_entry(torch.bfloat16, 64, True, root=str(tmp_path), long=True)
    assert not kernels.disk_entry(torch.bfloat16, 64, True, root=str(tmp_path))  # not the persistent one
    cute_env(CACHE="0")
    with pytest.raises(SystemExit):
        sanitize_cute.main(["--compile-only", "--only", "d64_causal_long_3wg"])
