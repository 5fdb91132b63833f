import os

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter on CPU tensors. The interpreter is chosen when a
# kernel is defined, so this must happen before any test module imports a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cute_env(monkeypatch):
    """Set flash_attn.cute's environment for one test: ``cute_env(OVERRIDES="fwd.stages=2", DISABLE="bwd")`` sets
    FLASH_ATTN_CUTE_OVERRIDES / FLASH_ATTN_CUTE_DISABLE / ... (None or "" unsets) and has the package read it again;
    the test's end restores the environment and reads it once more."""
    settings = pytest.importorskip("flash_attn.cute.settings")

    def set_env(**names):
        for name, value in names.items():
            var = "FLASH_ATTN_CUTE_" + name
            if value is None or value == "":
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, str(value))
        return settings.reload()

    set_env(OVERRIDES=None, DISABLE=None)
    yield set_env
    monkeypatch.undo()
    settings.reload()


@pytest.fixture
def fa_env(monkeypatch):
    """As cute_env, for the root package's settings (flash_attn/settings.py): ``fa_env(FP32_WGRAD="1",
    OVERRIDES="linear.wgrad_bias=torch")`` sets FLASH_ATTN_FP32_WGRAD / FLASH_ATTN_OVERRIDES / ... and reloads."""
    from flash_attn import settings

    def set_env(**names):
        for name, value in names.items():
            var = "FLASH_ATTN_" + name
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, str(value))
        return settings.reload()

    yield set_env
    monkeypatch.undo()
    settings.reload()
