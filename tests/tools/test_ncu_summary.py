"""benchmarks/tools/ncu_summary.py on a small synthetic Nsight Compute source-page CSV."""
from benchmarks.tools import ncu_summary

CSV = '''==PROF== Connected to process 1
"Kernel Name","k",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","Thread Instructions Executed","stall_wait","stall_wait (Not Issued)","stall_barrier"
"0x10","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24","5","8","256","1","1","0"
"0x20","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24","40","64","2048","4","2","1"
"0x30","@!P0 IMAD.MOV.U32 R1, RZ, RZ, R2","7","64","1024","2","0","3"
"0x40","MUFU.EX2 R4, R4","9","64","2048","0","0","0"
"0x50","EXIT","1","8","256","0","0","0"
'''


def test_summary_of_a_source_page(tmp_path):
    path = tmp_path / "ncusrc.csv"
    path.write_text(CSV)
    s = ncu_summary.summarise(ncu_summary.read_rows(str(path)))
    assert s["instructions"] == 5 and s["warp_instructions_executed"] == 208
    assert s["avg_threads"] == (256 + 2048 + 1024 + 2048 + 256) / 208
    assert dict(s["stalls"]) == {"wait": 7, "barrier": 4}  # "(Not Issued)" columns left out
    # the loop: what runs as often as the most executed HGMMA (64x), predicated opcodes included
    assert s["loop_executions"] == 64 and s["loop_body"] == 3
    assert dict(s["loop_histogram"]) == {"HGMMA": 1, "IMAD": 1, "MUFU": 1}
    assert [addr for addr, _, _ in s["hot"][:2]] == ["0x20", "0x40"]
