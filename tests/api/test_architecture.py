"""The repository's structural rules, checked on the sources (docs/ARCHITECTURE.md states them):
the environment is read only in each distribution's settings module; the FLASH_ATTN_* variables are the documented
few; a backend never imports the front door's private modules; no source file outgrows ~800 lines."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("flash_attn", "packages", "ops", "modules", "models", "training")
           for p in sorted((ROOT / d).rglob("*.py"))]
SETTINGS = {ROOT / "flash_attn/settings.py", ROOT / "packages/flash-attn-4/flash_attn/cute/settings.py",
            ROOT / "packages/flash-attn-triton/flash_attn/triton/settings.py"}
# torchrun's variables, read where the distributed run starts
DISTRIBUTED = {ROOT / "training/trainer.py"}
VARIABLES = {"FLASH_ATTN_BACKEND", "FLASH_ATTN_FP32_WGRAD", "FLASH_ATTN_WEIGHT_CAST_CACHE", "FLASH_ATTN_DISABLE",
             "FLASH_ATTN_OVERRIDES", "FLASH_ATTN_CUTE_CACHE", "FLASH_ATTN_CUTE_CACHE_VERBOSE", "FLASH_ATTN_CUTE_DISABLE",
             "FLASH_ATTN_CUTE_OVERRIDES", "FLASH_ATTN_TRITON_OVERRIDES"}


def test_sources_exist():
    assert len(SOURCES) > 50 and all(p.exists() for p in SETTINGS)


def test_environment_read_only_in_settings_modules():
    readers = {p for p in SOURCES if re.search(r"os\.environ|getenv\(", p.read_text())}
    assert readers - SETTINGS - DISTRIBUTED == set()


def test_flash_attn_variables_are_the_documented_ones():
    named = {m for p in SOURCES for m in re.findall(r"FLASH_ATTN_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    assert named <= VARIABLES, sorted(named - VARIABLES)
    defined = {m for p in SETTINGS for m in re.findall(r'"(FLASH_ATTN_[A-Z0-9_]+)"', p.read_text())}
    assert defined == VARIABLES


def test_backends_do_not_import_the_front_doors_private_modules():
    private = re.compile(r"^\s*(from flash_attn(\.(_ops|dispatch|_checks|reference|testing))? import "
                         r"(?!settings)|import flash_attn\.(_ops|dispatch|_checks))", re.M)
    for pkg in ("packages/flash-attn-4", "packages/flash-attn-triton"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            hits = [m.group(0).strip() for m in private.finditer(p.read_text())
                    if not m.group(0).strip().startswith(("from flash_attn.cute", "from flash_attn.triton"))]
            assert not hits, (p.relative_to(ROOT), hits)


def test_backends_do_not_import_each_other():
    other = {"packages/flash-attn-4": "triton", "packages/flash-attn-triton": "cute"}
    found = set()
    for pkg, name in other.items():
        pattern = re.compile(rf"^\s*(from flash_attn\.{name}\b.*|import flash_attn\.{name}\b.*"
                             rf"|from flash_attn import .*\b{name}\b.*)$", re.M)
        for p in sorted((ROOT / pkg).rglob("*.py")):
            found |= {(str(p.relative_to(ROOT)), m.group(0).strip()) for m in pattern.finditer(p.read_text())}
    assert found == set(), sorted(found)


def test_the_core_reaches_backends_only_through_the_registry():
    # dispatch.BACKENDS names the backend modules; cli.py only locates the distributions for `flash-attn info`
    named = re.compile(r"flash_attn\.(cute|triton)\b")
    allowed = {ROOT / "flash_attn/dispatch.py", ROOT / "flash_attn/cli.py"}
    core = [p for p in SOURCES if "packages" not in p.relative_to(ROOT).parts and p not in allowed]
    hits = {(str(p.relative_to(ROOT)), line.strip()) for p in core for line in p.read_text().splitlines()
            if named.search(line) and re.match(r"\s*(from|import)\s", line)}
    assert hits == set(), sorted(hits)


def test_no_source_file_outgrows_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 800}
    assert long == {}, long
