"""The layout installs as designed: the root wheel maps modules/, ops/, models/, training/ into
flash_attn.*, an editable install resolves the same imports from the checkout, and each backend
distribution under packages/ installs alone and joins the flash_attn namespace."""
import os
import site
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BACKEND_DISTS = sorted(d for d in os.listdir(os.path.join(ROOT, "packages"))
                       if os.path.isfile(os.path.join(ROOT, "packages", d, "pyproject.toml")))


def _pip(*args, cwd=None):
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True, cwd=cwd)


def _build_wheel(src, out):
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), src)
    (whl,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    return os.path.join(out, whl)


def _run(code, pythonpath, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def root_install(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("root")
    whl = _build_wheel(ROOT, tmp / "dist")
    _pip("install", "--no-deps", "--target", str(tmp / "site"), whl)
    return tmp / "site"


def test_wheel_maps_root_folders_into_flash_attn(root_install, tmp_path):
    r = _run("""
        import flash_attn, flash_attn.modules, flash_attn.ops, flash_attn.models, flash_attn.training
        import flash_attn.bert_padding, flash_attn.cli
        import flash_attn_interface  # FA3's top-level module
        for m in (flash_attn, flash_attn.modules, flash_attn.ops, flash_attn.models, flash_attn.training,
                  flash_attn_interface):
            assert m.__file__.startswith(SITE), m.__file__
        assert flash_attn_interface.flash_attn_func.__module__ == "flash_attn.fa3_interface"
        print(flash_attn.__path__)
    """.replace("SITE", repr(str(root_install))), [str(root_install)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (root_install / "modules").exists()  # mapped, not installed as a top-level package


def test_transformers_takes_the_installed_wheel_as_flash_attention_2(root_install, tmp_path):
    """transformers enables attn_implementation="flash_attention_2" from the installed flash-attn distribution that
    provides flash_attn (version 2.3.3 or later) and a CUDA device: with a device, it takes the installed wheel (the
    version is FA2's API level). (An editable install maps no files to flash_attn, so the wheel is what is checked.)"""
    pytest.importorskip("transformers")
    r = _run("""
        import importlib.metadata
        import flash_attn
        from packaging.version import Version
        from transformers.utils import import_utils
        assert flash_attn.__file__.startswith(SITE), flash_attn.__file__
        assert "flash-attn" in [d.replace("_", "-") for d in importlib.metadata.packages_distributions()["flash_attn"]]
        assert Version(flash_attn.__version__) >= Version("2.3.3")
        import_utils.is_torch_cuda_available = lambda: True
        import_utils.is_flash_attn_2_available.cache_clear()
        print(import_utils.is_flash_attn_2_available())
    """.replace("SITE", repr(str(root_install))), [str(root_install)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_installed_root_runs_attention_on_reference_backend(root_install, tmp_path):
    r = _run("""
        import torch, flash_attn
        from flash_attn import dispatch
        q = torch.randn(1, 8, 2, 16)
        out = flash_attn.flash_attn_func(q, q, q, causal=True)
        assert out.shape == q.shape
        print(dispatch.select(dispatch.Call("cpu", torch.float32, 16, 16)).NAME)
    """, [str(root_install)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("torch")


def test_editable_install_resolves_from_checkout(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # --system-site-packages shows the base interpreter's packages; when this suite runs in a virtual environment
    # the build backend (hatchling) and torch live in that environment's site-packages: list them too
    inner_site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(inner_site, "_outer_environment.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([py, "-m", "pip", "-q", "--disable-pip-version-check", "install", "--no-deps",
                    "--no-build-isolation", "-e", ROOT], check=True)
    code = ("import flash_attn.modules as m, flash_attn.ops as o, flash_attn_interface as f3; print(m.__file__); "
            "print(o.__file__); print(f3.__file__)")
    r = subprocess.run([py, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [os.path.join(ROOT, "modules", "__init__.py"),
                                os.path.join(ROOT, "ops", "__init__.py"), os.path.join(ROOT, "flash_attn_interface.py")]


@pytest.mark.parametrize("dist", BACKEND_DISTS)
def test_backend_distribution_installs_alone(dist, tmp_path):
    whl = _build_wheel(os.path.join(ROOT, "packages", dist), tmp_path / "dist")
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(site), whl)
    assert not (site / "flash_attn" / "__init__.py").exists(), "a backend must not own the namespace root"
    backends = [d for d in os.listdir(site / "flash_attn") if not d.startswith("_")]
    assert len(backends) == 1, backends
    r = _run(f"import flash_attn.{backends[0]} as b; print(b.__file__)", [str(site)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(site))


@pytest.mark.parametrize("dist", BACKEND_DISTS)
def test_backend_joins_installed_root_namespace(dist, root_install, tmp_path):
    whl = _build_wheel(os.path.join(ROOT, "packages", dist), tmp_path / "dist")
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(site), whl)
    (backend,) = [d for d in os.listdir(site / "flash_attn") if not d.startswith("_")]
    r = _run(f"""
        import flash_attn, flash_attn.{backend} as b, flash_attn.modules
        from flash_attn import dispatch
        assert b.__file__.startswith({str(site)!r}), b.__file__
        print(dispatch.unavailable_reason({backend!r}) or "available")
    """, [str(root_install), str(site)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "not installed" not in r.stdout
