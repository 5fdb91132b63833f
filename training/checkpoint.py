"""Training checkpoints: one file per save, written atomically, with a ``latest`` pointer.

A save writes ``step_XXXXXXX.pt.tmp``, flushes it to disk, renames it to ``step_XXXXXXX.pt`` (a rename is
atomic on POSIX), then replaces the one-line ``latest`` file the same way. A crash at any moment leaves
``latest`` naming a complete checkpoint. Model and optimizer states are gathered in full (not sharded) by
PyTorch's ``torch.distributed.checkpoint.state_dict`` helpers, so a checkpoint written by FSDP loads into
DDP, a single process, or ``generate``, and vice versa.
"""
import os
import re

import torch

from flash_attn.training.config import ConfigError

FORMAT = "flash_attn.training/1"
LATEST = "latest"
_STEP_FILE = re.compile(r"^step_(\d{7,})\.pt$")


def _full_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gather_model_state(model):
    """Full, CPU-resident model state dict (under FSDP only rank 0's is filled; the others get {})."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options(cpu_offload=True))


def gather_optimizer_state(model, optimizer):
    """Full optimizer state keyed by parameter names (not ids), so it survives a change of wrapper."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))


def load_model_state(model, state, broadcast=False):
    """Load a full model state dict; broadcast=True: only rank 0 passes it (the others pass {})."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_full_options(broadcast_from_rank0=broadcast))


def load_optimizer_state(model, optimizer, state, broadcast=False):
    """Load a full optimizer state dict (as gather_optimizer_state wrote it); broadcast as for the model."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_full_options(broadcast_from_rank0=broadcast))


def _atomic_write(path, write):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename itself must reach the disk before `latest` can point at the file.
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(ckpt_dir, step, state, keep=0):
    """Write state as step_<step>.pt in ckpt_dir, point ``latest`` at it, and delete all but the newest
    ``keep`` step files (0 keeps all). Call on one process only. Returns the checkpoint's path."""
    os.makedirs(ckpt_dir, exist_ok=True)
    name = f"step_{step:07d}.pt"
    path = os.path.join(ckpt_dir, name)
    _atomic_write(path, lambda f: torch.save(dict(state, format=FORMAT), f))
    _atomic_write(os.path.join(ckpt_dir, LATEST), lambda f: f.write((name + "\n").encode()))
    if keep > 0:
        steps = sorted(f for f in os.listdir(ckpt_dir) if _STEP_FILE.match(f))
        for old in steps[:-keep]:
            if old != name:
                os.remove(os.path.join(ckpt_dir, old))
    return path


def latest_checkpoint(ckpt_dir):
    """Path of the checkpoint ``latest`` names in ckpt_dir, or None when there is none yet."""
    pointer = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(ckpt_dir, name)
    if not _STEP_FILE.match(name) or not os.path.isfile(path):
        raise ConfigError(f"{pointer!r} names {name!r}, which is not a checkpoint in {ckpt_dir!r}")
    return path


def resolve_checkpoint(path):
    """A checkpoint file, a checkpoint folder (its latest) or a run folder (its checkpoints/ latest)."""
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        for folder in (path, os.path.join(path, "checkpoints")):
            found = latest_checkpoint(folder)
            if found is not None:
                return found
        raise FileNotFoundError(f"no checkpoint in {path!r} (looked for {LATEST} there and in checkpoints/)")
    raise FileNotFoundError(f"checkpoint not found: {path!r}")


def load_checkpoint(path):
    """The state dict saved by save_checkpoint, on the CPU; raises if the file is not one of ours."""
    path = resolve_checkpoint(path)
    try:
        # Checkpoints hold only tensors and plain Python values, so the safe unpickler reads them.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"cannot read checkpoint {path!r}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"{path!r} is not a flash_attn.training checkpoint (format {FORMAT!r})")
    state["path"] = path
    return state
