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
