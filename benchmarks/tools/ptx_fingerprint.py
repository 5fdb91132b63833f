"""Fingerprint the PTX of flash_attn.cute's default kernel configurations, compiled for sm_90a on the CPU.

A refactor that must not change the default kernels runs this before and after and compares the output
(``--out before.json`` then ``--out after.json --against before.json``). Each line is one configuration:
its disk-cache key (the selected config) and the SHA-256 of its PTX, with the module's file-name line
dropped (it names the dump folder).

    CUTE_DSL_ARCH=sm_90a python benchmarks/tools/ptx_fingerprint.py --out /tmp/ptx.json
"""
import argparse
import glob
import hashlib
import json
import os
import sys
import tempfile

import torch

# (name, compile function, its keyword arguments): the forward's and the backward's default configurations.
FWD = [
    ("dense-d64", dict(head_dim=64, causal=False)),
    ("dense-d128-causal", dict(head_dim=128, causal=True)),
    ("dense-d256-causal", dict(head_dim=256, causal=True)),
    ("dense-d128-short", dict(head_dim=128, causal=False, short=True)),
    ("dense-d64-causal-long", dict(head_dim=64, causal=True, long=True)),
    ("varlen-d128", dict(head_dim=128, causal=True, varlen=True)),
    ("varlen-d128-sink", dict(head_dim=128, causal=False, varlen=True, sink=True)),
    ("window-softcap-d128", dict(head_dim=128, causal=False, local=True, softcap=True)),
    ("paged-d128", dict(head_dim=128, causal=True, varlen=True, paged=64)),
    ("split-d128", dict(head_dim=128, causal=False, split=True)),
    ("pack4-d128", dict(head_dim=128, causal=True, pack=4)),
]
BWD = [
    ("bwd-d64", dict(head_dim=64, causal=False)),
    ("bwd-d128-causal", dict(head_dim=128, causal=True)),
]


def _ptx_digest(folder):
    paths = sorted(glob.glob(os.path.join(folder, "**", "*.ptx"), recursive=True))
    if not paths:
        raise RuntimeError(f"no PTX written under {folder}")
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                if not line.startswith(b"//") and b".file" not in line:
                    h.update(line)
    return h.hexdigest()


def fingerprint(names=None):
    from flash_attn.cute import kernels

    out = {}
    jobs = [(n, "fwd", kw) for n, kw in FWD] + [(n, "bwd", kw) for n, kw in BWD]
    for name, kind, kw in jobs:
        if names and name not in names:
            continue
        with tempfile.TemporaryDirectory() as folder:
            if kind == "fwd":
                key = kernels.fwd_config(torch.bfloat16, arch="sm_90a", **kw).key()
                kernels.compile_fwd(torch.bfloat16, arch="sm_90a", dump_dir=folder, **kw)
            else:
                key = kernels.bwd_config(torch.bfloat16, arch="sm_90a", **kw).key()
                kernels.compile_bwd(torch.bfloat16, arch="sm_90a", dump_dir=folder, **kw)
            out[name] = {"config": key, "ptx_sha256": _ptx_digest(folder)}
        print(name, out[name]["ptx_sha256"][:16], json.dumps(key, sort_keys=True), flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--against", help="an earlier output; exit 1 when any PTX differs")
    p.add_argument("--only", nargs="*", help="configuration names (default: all)")
    args = p.parse_args(argv)
    result = fingerprint(args.only)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        changed = [n for n in result if n in before and before[n]["ptx_sha256"] != result[n]["ptx_sha256"]]
        for n in changed:
            print(f"PTX CHANGED: {n}")
        print(f"{len(result) - len(changed)} of {len(result)} identical")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
