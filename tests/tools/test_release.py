"""The release job of flash-attn-4 (.github/workflows/release.yml): one precompile --prebuilt per CUDA flavour of
CuTeDSL's runtime, one wheel holding both, checked by .github/scripts/check_prebuilt_wheel.py (its findings on
wheels made here)."""
import importlib.util
import json
import pathlib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
yaml = pytest.importorskip("yaml")


def _checker():
    spec = importlib.util.spec_from_file_location("check_prebuilt_wheel",
                                                  ROOT / ".github" / "scripts" / "check_prebuilt_wheel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_release_job_precompiles_each_flavour_then_builds_and_checks_one_wheel():
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    jobs = wf["jobs"]
    assert jobs["prebuilt"]["strategy"]["matrix"]["flavour"] == ["cu12", "cu13"]
    steps = " ".join(s.get("run", "") for s in jobs["prebuilt"]["steps"])
    assert "precompile --prebuilt" in steps and "nvidia-cutlass-dsl-libs-cu12" in steps
    assert jobs["wheel"]["needs"] == "prebuilt"
    wheel_steps = " ".join(s.get("run", "") for s in jobs["wheel"]["steps"])
    assert "hatch build" in wheel_steps and "check_prebuilt_wheel.py" in wheel_steps and "cu12,cu13" in wheel_steps
    merged = [s for s in jobs["wheel"]["steps"] if "download-artifact" in s.get("uses", "")]
    assert merged and merged[0]["with"]["merge-multiple"] is True


def _wheel(tmp_path, entries, version="0.1.0"):
    path = tmp_path / "flash_attn_4-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, (flavour, config, with_o) in entries.items():
            manifest = {"config": config, "env": {"cute-runtime": [flavour], "flash-attn-4": version}}
            z.writestr(f"flash_attn/cute/_prebuilt/{name}.json", json.dumps(manifest))
            if with_o:
                z.writestr(f"flash_attn/cute/_prebuilt/{name}.o", b"\0")
        z.writestr("flash_attn/cute/__init__.py", "")
    return path


def test_checker_passes_both_flavours_and_names_what_is_missing(tmp_path):
    check = _checker()
    a, b = {"d": 64}, {"d": 128}
    good = _wheel(tmp_path, {"e1": ("cu12", a, True), "e2": ("cu13", a, True), "e3": ("cu12", b, True),
                             "e4": ("cu13", b, True)})
    assert check.problems(str(good), ["cu12", "cu13"], "0.1.0") == []
    assert check.main([str(good), "--version", "0.1.0"]) == 0
    missing = _wheel(tmp_path, {"e1": ("cu12", a, True), "e2": ("cu13", a, True), "e3": ("cu12", b, False)})
    found = check.problems(str(missing), ["cu12", "cu13"])
    assert any("no entry for cu13" in f and '"d": 128' in f for f in found)
    assert any("object file is missing" in f for f in found)
    assert check.problems(str(good), ["cu12", "cu13"], "0.2.0")  # keyed for another version
    empty = _wheel(tmp_path, {})
    assert check.main([str(empty)]) == 1
