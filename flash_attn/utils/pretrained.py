"""Hugging Face checkpoints as state dicts (FlashAttention-2's ``flash_attn.utils.pretrained``).

``state_dict_from_pretrained(model_name)`` reads the weights of a model saved by ``save_pretrained`` (one file or
shards behind an index, pickle or safetensors) from a local folder or from the Hugging Face hub, through its local
cache (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` as huggingface_hub reads them). The model files' ``remap_state_dict_hf_*``
functions turn the result into this package's parameter names.
"""
import json
import os

import torch

WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# (file name, sharded, safetensors), in FA2's order of preference: a folder holding both formats (the same weights)
# loads the pickle, as FA2 does.
_CANDIDATES = (
    (WEIGHTS_NAME, False, False),
    (WEIGHTS_INDEX_NAME, True, False),
    (SAFE_WEIGHTS_NAME, False, True),
    (SAFE_WEIGHTS_INDEX_NAME, True, True),
)


def state_dict_from_pretrained(model_name, device=None, dtype=None):
    """The state dict of a Hugging Face checkpoint: ``{name: tensor}`` as saved.

    model_name: a folder written by ``save_pretrained``, or a hub repo id (``"gpt2"``, ``"org/name"``) resolved
        through the local hub cache (downloading what is missing unless ``HF_HUB_OFFLINE=1``).
    device: where the tensors go (None: the CPU).
    dtype: floating-point tensors are cast to it (on the CPU, before moving, so the device receives the smaller
        tensors); integer and bool tensors keep theirs. None keeps the checkpoint's dtypes.
    Raises FileNotFoundError (an OSError, like FA2's) naming model_name and the places searched when no checkpoint
    is found.
    """
    if not isinstance(model_name, (str, os.PathLike)):
        raise TypeError(f"state_dict_from_pretrained: model_name must be a str or os.PathLike (a folder or a hub "
                        f"repo id), got {type(model_name).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"state_dict_from_pretrained: dtype must be a torch.dtype or None, got {dtype!r}")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"state_dict_from_pretrained: device={device!r} is not a torch device ({e})") from None
    model_name = os.fspath(model_name)

    source = _Folder(model_name) if os.path.isdir(model_name) else _Hub(model_name)
    for name, sharded, safe in _CANDIDATES:
        path = source.find(name)
        if path is not None:
            break
    else:
        raise FileNotFoundError(f"state_dict_from_pretrained: no checkpoint for model_name={model_name!r}: looked "
                                f"for {', '.join(c[0] for c in _CANDIDATES)} {source.where()}")

    files = _shard_files(path, source) if sharded else [path]
    # A cast changes the size, so it happens on the CPU and only the result travels; without one the tensors load
    # straight onto the device.
    load_device = torch.device("cpu") if dtype not in (None, torch.float32) or device is None else device
    state_dict = {}
    for file in files:
        state_dict.update(_load_file(file, safe, load_device))
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if device is not None:
        state_dict = {k: v.to(device) for k, v in state_dict.items()}
    return state_dict


class _Folder:
    def __init__(self, folder):
        self.folder = folder

    def find(self, name):
        path = os.path.join(self.folder, name)
        return path if os.path.isfile(path) else None

    def where(self):
        return f"in the folder {os.path.abspath(self.folder)}"


class _Hub:
    """Files of a hub repo through huggingface_hub's cache (which downloads a missing file unless offline)."""

    def __init__(self, repo_id):
        try:
            import huggingface_hub  # noqa: F401
        except ImportError as e:
            raise ImportError(f"state_dict_from_pretrained: model_name={repo_id!r} is not a folder, and reading it "
                              f"from the Hugging Face hub needs huggingface_hub (pip install huggingface_hub)") from e
        self.repo_id = repo_id
        self.notes = []

    def find(self, name):
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HFValidationError,
                                            LocalEntryNotFoundError, RepositoryNotFoundError)

        try:
            return hf_hub_download(self.repo_id, name)
        except GatedRepoError:
            raise  # the repo exists; its own message says how to get access
        except HFValidationError as e:
            # a folder path that does not exist reads as an invalid repo id: the message says both
            self.notes.append(f"not a valid hub repo id ({e})")
        except LocalEntryNotFoundError:
            self.notes.append("not in the cache" + (", and offline" if constants.HF_HUB_OFFLINE else ""))
        except EntryNotFoundError:
            self.notes.append(f"the repo has no {name}")
        except RepositoryNotFoundError:
            self.notes.append("no such repo, or no access to it")
        return None

    def where(self):
        from huggingface_hub import constants

        mode = "offline: HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "online"
        notes = "; ".join(dict.fromkeys(self.notes))
        return (f"on the Hugging Face hub through its cache {constants.HF_HUB_CACHE} ({mode}; model_name is not a "
                f"local folder){': ' + notes if notes else ''}")


def _shard_files(index_path, source):
    with open(index_path) as f:
        try:
            index = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"state_dict_from_pretrained: the shard index {index_path} is not JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"state_dict_from_pretrained: the shard index {index_path} has no 'weight_map'")
    files = []
    for shard in sorted(set(weight_map.values())):
        path = source.find(shard)
        if path is None:
            raise FileNotFoundError(f"state_dict_from_pretrained: shard {shard} listed in {index_path} is missing")
        files.append(path)
    return files


def _load_file(path, safe, device):
    if safe:
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ImportError(f"state_dict_from_pretrained: {path} is a safetensors file, which needs safetensors "
                              f"(pip install safetensors)") from e
        return load_file(path, device=str(device))
    return torch.load(path, map_location=device, weights_only=True)
