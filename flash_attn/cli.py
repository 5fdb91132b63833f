"""The ``flash-attn`` command.

    flash-attn info                                   device, versions, and each backend's state
    flash-attn train --config tiny [section.field=v]  train a model (see flash_attn.training)
    flash-attn generate RUN --prompt "..."            sample from a checkpoint
    flash-attn prepare corpus.txt tokens.npy          tokenize a text file for training
"""
import argparse
import importlib.metadata
import importlib.util
import platform
import sys

TRAINING_COMMANDS = ("train", "generate", "prepare")  # flash_attn.training.cli.COMMANDS, imported lazily


# backend distributions -> the module each installs in the flash_attn namespace
_BACKEND_MODULES = {"flash-attn-4": "flash_attn.cute", "flash-attn-triton": "flash_attn.triton"}


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        module = _BACKEND_MODULES.get(dist)
        spec = importlib.util.find_spec(module) if module is not None else None
        if spec is not None and spec.submodule_search_locations:
            # a source checkout: the namespace finds the package's folder without an installed distribution
            return f"from the source tree ({list(spec.submodule_search_locations)[0]})"
        return "not installed"


def info(out=None):
    out = sys.stdout if out is None else out
    import torch

    import flash_attn
    from flash_attn import dispatch

    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"flash_attn {flash_attn.__version__} ({flash_attn.__path__[0]})")
    hip = getattr(torch.version, "hip", None)
    p(f"python {platform.python_version()}, torch {torch.__version__} "
      f"({f'ROCm {hip}' if hip else f'CUDA {torch.version.cuda}'})")
    for dist in ("triton", "nvidia-cutlass-dsl", "flash-attn-4", "flash-attn-triton", "transformers"):
        p(f"  {dist}: {_version(dist)}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if hip:  # an AMD GPU: its gfx name (its "capability" can read as an NVIDIA one's: MI200 (9, 0))
                arch = torch.cuda.get_device_properties(i).gcnArchName.split(":")[0]
            else:
                arch = "sm_{}{}".format(*torch.cuda.get_device_capability(i))
            p(f"device cuda:{i}: {torch.cuda.get_device_name(i)} ({arch})")
    else:
        p("device: cpu (no CUDA device)")
    forced = dispatch.forced_backend()
    if forced:
        p(f"forced backend: {forced} (FLASH_ATTN_BACKEND or use_backend)")
    p("backends (priority order):")
    for name in dispatch.BACKENDS:
        reason = dispatch.unavailable_reason(name)
        p(f"  {name:7s} {'available' if reason is None else 'unavailable: ' + reason}")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TRAINING_COMMANDS:  # the training commands keep their own parser
        from flash_attn.training.cli import main as training_main

        return training_main(argv, prog="flash-attn")
    parser = argparse.ArgumentParser(prog="flash-attn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="device, versions and the state of each attention backend")
    for name in TRAINING_COMMANDS:
        sub.add_parser(name, help=f"training: flash-attn {name} --help")
    args = parser.parse_args(argv)
    return info() if args.command == "info" else 2


if __name__ == "__main__":
    sys.exit(main())
