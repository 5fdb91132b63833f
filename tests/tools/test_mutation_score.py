"""benchmarks/tools/mutation_score.py without mutmut: the scratch copy's layout and configuration, the fenced GPU launch
functions, the parsing of mutmut's results, the table's arithmetic, and equivalent survivors matched on their line."""
import ast
import configparser
import subprocess

import pytest

from benchmarks.tools import mutation_score as ms


def test_scratch_copy_is_the_wheel_layout_with_the_suites_config(tmp_path):
    files = ms.build_scratch(tmp_path / "w", ["cross_entropy", "dispatch"])
    w = tmp_path / "w"
    for sub in ("ops", "modules", "models", "training"):
        assert (w / "flash_attn" / sub / "__init__.py").is_file()
    assert not (w / "ops").exists()
    assert files == ms.SUITES["cross_entropy"][0] + ms.SUITES["dispatch"][0]
    cfg = configparser.ConfigParser()
    cfg.read(w / "setup.cfg")
    assert [f for f in cfg.get("mutmut", "only_mutate").split("\n") if f] == files
    tests = [t for t in cfg.get("mutmut", "tests_dir").split("\n") if t]
    assert set(tests) == set(ms.SUITES["cross_entropy"][1] + ms.SUITES["dispatch"][1])
    for t in tests:
        assert (w / t).exists(), t


def test_gpu_launch_functions_are_fenced(tmp_path):
    ms.build_scratch(tmp_path / "w", ["rotary"])
    for rel, names in ms.GPU_LAUNCH.items():
        source = (tmp_path / "w" / rel).read_text()
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                assert lines[node.lineno - 2] == "# pragma: no mutate start", (rel, node.name)
                assert lines[node.end_lineno] == "# pragma: no mutate end", (rel, node.name)


def test_every_suites_files_exist_in_the_wheel_layout(tmp_path):
    ms.build_scratch(tmp_path / "w", list(ms.SUITES))
    for files, tests in ms.SUITES.values():
        for f in files:
            assert (tmp_path / "w" / f).is_file(), f


def test_export_head_is_the_committed_tree(tmp_path):
    head = ms.export_head(tmp_path / "h")
    listed = subprocess.run(["git", "-C", str(ms.ROOT), "ls-files", "flash_attn/call.py"], capture_output=True,
                            text=True).stdout.strip()
    assert listed == "flash_attn/call.py" and (head / "flash_attn" / "call.py").is_file()


def test_parse_and_table(monkeypatch, tmp_path):
    out = """
    flash_attn.call.x_window__mutmut_1: killed
    flash_attn.call.x_window__mutmut_2: survived
    flash_attn.call.x_window__mutmut_3: survived
    flash_attn.call.x_dense__mutmut_1: timeout
    flash_attn.dispatch.x_load__mutmut_4: no tests
    flash_attn.dispatch.x_load__mutmut_5: not checked
"""
    rows = ms.parse(out)
    assert rows["flash_attn.call.x_window__mutmut_2"] == "survived" and len(rows) == 6
    lines = {"flash_attn.call.x_window__mutmut_2": "if type(None) is tuple and window_size == (-1, -1):",
             "flash_attn.call.x_window__mutmut_3": "left, right = None"}
    monkeypatch.setattr(ms, "mutated_line", lambda workdir, name: lines[name])
    table, survivors = ms.table(rows, ["flash_attn/call.py", "flash_attn/dispatch.py"], tmp_path)
    assert survivors == ["flash_attn.call.x_window__mutmut_3", "flash_attn.dispatch.x_load__mutmut_4"]
    # call.py: 4 mutants, 2 caught (killed + timeout), 1 survivor, 1 equivalent -> 2 / 3
    assert table[2] == "| `flash_attn/call.py` | 4 | 2 | 1 | 0 | 1 | 66.7% |"
    # dispatch.py: one without tests, one not checked (left out of the score)
    assert table[3] == "| `flash_attn/dispatch.py` | 2 | 0 | 0 | 1 | 0 | 0.0% |"


@pytest.mark.parametrize("entry", ms.EQUIVALENT, ids=lambda e: f"{e[0]}:{e[1][:30]}")
def test_equivalent_entries_name_a_function_that_exists(entry):
    # mutmut names a function module.x_name and a method module.x\u01c1Class\u01c1name
    function, piece, why = entry
    if "\u01c1" in function:
        module, _, qualname = function.partition(".x\u01c1")
        cls, _, name = qualname.partition("\u01c1")
    else:
        module, _, name = function.rpartition(".x_")
        cls = None
    rel = module.replace(".", "/") + ".py"
    path = ms.ROOT / rel
    if not path.exists():  # the root folders are flash_attn.<sub> in the wheel layout
        path = ms.ROOT / rel.split("/", 1)[1]
    source = path.read_text()
    assert f"def {name}(" in source, (function, rel)
    if cls is not None:
        assert f"class {cls}(" in source or f"class {cls}:" in source, (function, rel)
    assert why and piece
