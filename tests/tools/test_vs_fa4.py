"""benchmarks/attention/vs_fa4.py's driver on the CPU, with stub workers (fixed times per side, the order of the timing
requests logged): the sides alternate per round, a side's figure is the median of its rounds, the table's
ratios and the control column follow from the times, and a side that fails leaves its cells marked and the
exit status 1."""
import pytest

from benchmarks.attention import vs_fa4


def _run(monkeypatch, tmp_path, stub, *extra):
    log = tmp_path / "order.log"
    monkeypatch.setenv("VS_FA4_STUB", stub)
    monkeypatch.setenv("VS_FA4_STUB_LOG", str(log))
    rc = vs_fa4.main(["--peer-pythonpath", str(tmp_path / "peer"), "--headdims", "64", "--seqlens", "1024",
                      "--causal", "0,1", "--rounds", "3", "--out", str(tmp_path), *extra])
    return rc, (tmp_path / "vs_fa4.md").read_text(), log.read_text().split()


def test_rounds_alternate_and_ratios_follow(monkeypatch, tmp_path):
    rc, text, order = _run(monkeypatch, tmp_path, "ours=1.0,fa4=2.0,ours2=1.25", "--control")
    assert rc == 0
    per_cell = ["ours", "fa4", "ours2", "fa4", "ours2", "ours", "ours2", "ours", "fa4"]
    assert order == per_cell * 2  # two cells, three rounds each, rotated
    # 4 * 16 * 1024^2 * 32 * 64 / 1 ms = 137.4 TFLOP/s; causal half that
    assert "| 64 | False | 1024 | 137 | 69 | 110 | 2.000 | 0.800 |" in text
    assert "| 64 | True | 1024 | 69 | 34 | 55 | 2.000 | 0.800 |" in text
    assert "geometric mean 2.000" in text and "2 of 2 cells >= 1.0" in text
    assert "ratio to ours 0.800..0.800" in text
    assert '"$PEER_PYTHONPATH"' in text and str(tmp_path / "peer") not in text


def test_kernels_breakdown_per_side(monkeypatch, tmp_path):
    """--kernels: after each cell's rounds each side reports its kernels' device us per call; the report lists them
    per cell and side with their total."""
    rc, text, order = _run(monkeypatch, tmp_path, "ours=1.0,fa4=2.0", "--kernels")
    assert rc == 0 and len(order) == 12  # (the kernels requests are not timing requests)
    assert "- d64 s1024 causal=0, ours (1000 us): `ours_main` 800.0; `prep` 200.0" in text
    assert "- d64 s1024 causal=1, fa4 (2000 us): `fa4_main` 1600.0; `prep` 400.0" in text
    rc, text, _ = _run(monkeypatch, tmp_path, "ours=1.0,fa4=2.0")
    assert "Kernels per call" not in text


def test_median_of_rounds():
    assert vs_fa4.round_order(["a", "b", "c"], 4) == ["b", "c", "a"]
    cells = [(64, 1024, False, 16, 32)]

    class Fake:
        def __init__(self, name, times):
            self.name, self.times = name, iter(times)

        def ask(self, op, **kw):
            return {"device": "x", "versions": {}} if op == "setup" else {"ms": next(self.times)}

    res, _ = vs_fa4.compare([Fake("ours", [1.0, 9.0, 1.2]), Fake("fa4", [2.0, 2.2, 0.1])], cells, 3, 1, 1,
                            log=lambda *a: None)
    assert res[cells[0]] == {"ours": 1.2, "fa4": 2.0}


def test_a_failing_side_is_reported(monkeypatch, tmp_path):
    rc, text, _ = _run(monkeypatch, tmp_path, "ours=1.0")  # the fa4 stub has no time: its worker errors
    assert rc == 1
    assert "| 64 | False | 1024 | 137 | error | - |" in text


def test_decode_mode(monkeypatch, tmp_path):
    """--decode: decoding shapes, both sides set up with the shape and --call's options; us per call, fa4 / ours
    and ours' K / V read rate in vs_fa4_decode.md."""
    monkeypatch.setenv("VS_FA4_STUB", "ours=0.01,fa4=0.02")
    rc = vs_fa4.main(["--peer-pythonpath", str(tmp_path / "peer"), "--decode", "--shapes", "1:1:8192:32:8:128",
                      "--causal", "0", "--call", "num_splits=0,pack_gqa=None", "--rounds", "2",
                      "--out", str(tmp_path)])
    text = (tmp_path / "vs_fa4_decode.md").read_text()
    assert rc == 0
    # K and V: 8192 x 8 x 256 x 2 bytes = 33.6 MB in 10 us
    assert "| 1:1:8192:32:8:128 | False | 10.0 | 20.0 | 2.000 | 3355 |" in text
    assert "{'num_splits': 0, 'pack_gqa': None}" in text and "1 of 1 cells with ours at least as fast" in text
    req, label = vs_fa4._setup((1, 1, 8192, 32, 8, 128, True), {"num_splits": 0})
    assert req == dict(d=128, s=1, sk=8192, causal=1, b=1, h=32, hk=8, kw={"num_splits": 0})
    assert label == "1:1:8192:32:8:128 causal=1"
    assert vs_fa4._setup((64, 1024, False, 16, 32), {})[0] == dict(d=64, s=1024, causal=0, b=16, h=32)


def test_mods_mode_reports_tflops_on_the_kept_pairs(monkeypatch, tmp_path):
    """--mods: one cell per (case, head dim, seqlen), the sides alternating; TFLOP/s on the kept share the workers
    report (the stub's 0.5), ours / fa4 from the times; an unknown case is refused."""
    monkeypatch.setenv("VS_FA4_STUB", "ours=1.0,fa4=1.5")
    monkeypatch.setenv("VS_FA4_STUB_LOG", str(tmp_path / "order.log"))
    rc = vs_fa4.main(["--peer-pythonpath", str(tmp_path / "peer"), "--mods", "causal,document", "--headdims", "128",
                      "--seqlens", "4096", "--rounds", "2", "--out", str(tmp_path)])
    text = (tmp_path / "vs_fa4_mods.md").read_text()
    assert rc == 0
    # 4 * 4 * 4096^2 * 16 * 128 * 0.5 / 1 ms = 275 TFLOP/s; fa4 at 1.5 ms: 183
    assert "| causal | 128 | 4096 | 0.500 | 275 | 183 | 1.500 |" in text
    assert "| document | 128 | 4096 | 0.500 | 275 | 183 | 1.500 |" in text
    assert "geometric mean 1.500" in text and "2 of 2 cells >= 1.0" in text
    assert (tmp_path / "order.log").read_text().split() == ["ours", "fa4", "fa4", "ours"] * 2
    with pytest.raises(SystemExit):
        vs_fa4.main(["--peer-pythonpath", "x", "--mods", "causal,nope"])


def test_bwd_mode_times_the_backward_and_counts_its_flops(monkeypatch, tmp_path):
    """--bwd: the standard grid's cells set up with bwd=1 (the workers time torch.autograd.grad of their
    flash_attn_func), the sides alternating; TFLOP/s are 2.5 x the forward's FLOPs; vs_fa4_bwd.md; not with --mods
    or --decode."""
    monkeypatch.setenv("VS_FA4_STUB", "ours=2.5,fa4=2.0")
    monkeypatch.setenv("VS_FA4_STUB_LOG", str(tmp_path / "order.log"))
    rc = vs_fa4.main(["--peer-pythonpath", str(tmp_path / "peer"), "--bwd", "--headdims", "64", "--seqlens", "1024",
                      "--causal", "0", "--rounds", "2", "--out", str(tmp_path)])
    text = (tmp_path / "vs_fa4_bwd.md").read_text()
    assert rc == 0 and not (tmp_path / "vs_fa4.md").exists()
    # 2.5 * 137.4 TFLOP / 2.5 ms = 137; fa4 at 2.0 ms: 172
    assert "| 64 | False | 1024 | 137 | 172 | 0.800 |" in text
    assert "Cute backward vs the released FA4" in text and "geometric mean 0.800" in text
    assert (tmp_path / "order.log").read_text().split() == ["ours", "fa4", "fa4", "ours"]
    assert vs_fa4._setup((64, 1024, True, 16, 32), {}, bwd=True)[0] == dict(d=64, s=1024, causal=1, b=16, h=32, bwd=1)
    for other in (["--mods"], ["--decode"]):
        with pytest.raises(SystemExit):
            vs_fa4.main(["--peer-pythonpath", "x", "--bwd", *other])
