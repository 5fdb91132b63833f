"""Check a flash-attn-4 wheel's shipped kernels (the release job's last step): every configuration among the
wheel's flash_attn/cute/_prebuilt entries is there for each CUDA flavour of CuTeDSL's runtime named on the command
line, each entry with its object file, and every entry belongs to this wheel's version.

    python .github/scripts/check_prebuilt_wheel.py dist/flash_attn_4-*.whl --flavours cu12,cu13

Exit status 1 with the missing (configuration, flavour) pairs listed, 0 otherwise."""
import argparse
import json
import sys
import zipfile

PREFIX = "flash_attn/cute/_prebuilt/"


def entries(wheel):
    """{json name: manifest} of the wheel's shipped entries, and the set of file names under _prebuilt/."""
    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if n.startswith(PREFIX)}
        manifests = {n: json.loads(z.read(n)) for n in names if n.endswith(".json")}
    return manifests, names


def problems(wheel, flavours, version=None):
    """The check's findings, as lines (empty when the wheel passes)."""
    manifests, names = entries(wheel)
    found = []
    if not manifests:
        return [f"{wheel}: no shipped kernel entries under {PREFIX}"]
    have = {}
    for name, m in manifests.items():
        env = m.get("env", {})
        runtime = env.get("cute-runtime") or []
        if len(runtime) != 1:
            found.append(f"{name}: built with CuTeDSL runtime flavours {runtime}, expected exactly one")
            continue
        if name[:-len(".json")] + ".o" not in names:
            found.append(f"{name}: its object file is missing")
        if version is not None and env.get("flash-attn-4") != version:
            found.append(f"{name}: keyed for flash-attn-4 {env.get('flash-attn-4')}, the wheel is {version}")
        config = json.dumps(m.get("config"), sort_keys=True)
        have.setdefault(config, set()).add(runtime[0])
    for config, got in sorted(have.items()):
        for flavour in flavours:
            if flavour not in got:
                found.append(f"configuration {config}: no entry for {flavour} (have {sorted(got)})")
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel")
    ap.add_argument("--flavours", default="cu12,cu13")
    ap.add_argument("--version", default=None, help="the flash-attn-4 version every entry must be keyed for")
    args = ap.parse_args(argv)
    found = problems(args.wheel, [f for f in args.flavours.split(",") if f], args.version)
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        manifests, _ = entries(args.wheel)
        print(f"{args.wheel}: {len(manifests)} shipped entries, every configuration for {args.flavours}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
