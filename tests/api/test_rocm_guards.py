"""The NVIDIA-only kernels refuse AMD GPUs. A ROCm build of torch answers torch.cuda's capability query for AMD
devices, and an MI200 (gfx90a) says (9, 0), Hopper's: without a vendor check the CuTeDSL attention and LayerNorm
kernels would be chosen there and fail (the dispatcher must pick the Triton backend instead). Runs on CPU with a
ROCm torch and an sm_90 answer faked."""
import types

import pytest
import torch


@pytest.fixture
def mi200(monkeypatch):
    """torch as a ROCm build on an MI200: torch.version.hip set, capability (9, 0)."""
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def _cuda_tensor():
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), get_device=lambda: 0)


def test_cute_backend_is_unavailable_on_rocm(monkeypatch, mi200):
    backend = pytest.importorskip("flash_attn.cute.backend")
    monkeypatch.setattr(backend, "_unavailable", [])
    assert "ROCm" in backend.unavailable_reason()


def test_cute_api_refuses_a_rocm_device(monkeypatch, mi200):
    launch = pytest.importorskip("flash_attn.cute.launch")
    q = _cuda_tensor()
    monkeypatch.setattr(launch, "_device_archs", {})
    with pytest.raises(NotImplementedError, match="ROCm"):
        launch._device_arch(q, q, q)
    monkeypatch.setattr(torch.version, "hip", None)  # the same answer from an NVIDIA device: Hopper
    monkeypatch.setattr(launch, "_device_archs", {})
    assert launch._device_arch(q, q, q) == "sm_90a"


def test_cute_layer_norm_backward_not_on_rocm(monkeypatch, mi200):
    cb = pytest.importorskip("flash_attn.cute.norm_bwd")

    x = _cuda_tensor()
    assert not cb._on_hopper(x)
    monkeypatch.setattr(torch.version, "hip", None)
    assert cb._on_hopper(x)


def test_info_names_an_amd_gpu_by_its_gfx_arch(monkeypatch, mi200):
    import io

    from flash_attn import cli, dispatch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "AMD Instinct MI250X")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(gcnArchName="gfx90a:sramecc+:xnack-"))
    monkeypatch.setattr(dispatch, "_unavailable", {})  # the backends' answers under this fake device stay here
    cute_backend = pytest.importorskip("flash_attn.cute.backend")
    monkeypatch.setattr(cute_backend, "_unavailable", [])
    out = io.StringIO()
    assert cli.info(out) == 0
    text = out.getvalue()
    assert "(ROCm 6.4.0)" in text and "device cuda:0: AMD Instinct MI250X (gfx90a)" in text
    assert "sm_90" not in text
    assert "cute    unavailable: a ROCm build of torch" in text, text
