"""benchmarks/tools/sass_loops.py on a hand-written SASS listing: a loop is a backward branch and what it spans, kept
when it holds an HGMMA, innermost first; opcodes lose their predicate and modifiers."""
from benchmarks.tools import sass_loops

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0020*/                   FMUL R2, R3, R4 ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/                   FADD R2, R3, R4 ;
        /*0050*/              @!P1 BRA 0x40 ;
        /*0060*/                   MUFU.EX2 R5, R6 ;
        /*0070*/                   BRA 0x0 ;
        /*0080*/                   EXIT ;
"""


def test_loops_with_wgmmas_innermost_first():
    found, total = sass_loops.loops(SASS)
    assert total == 9
    assert [(first, last) for first, last, _ in found] == [(0x10, 0x30), (0x0, 0x70)]  # (0x40-0x50: no HGMMA)
    assert found[0][2] == ["HGMMA", "FMUL", "BRA"]
    assert found[1][2].count("BRA") == 3 and "MUFU" in found[1][2]


def test_opcode_drops_predicate_and_modifiers():
    assert sass_loops.opcode("@!P0 BRA 0x22c0") == "BRA"
    assert sass_loops.opcode("HGMMA.64x64x16.F32.BF16 R184, gdesc[UR8], R184") == "HGMMA"
    assert sass_loops.opcode("") == ""
