"""Convert a checkpoint once into a Flax conversion folder that `jaxspec.load` restores without converting again.

    jaxspec-convert path/to/hf-folder converted/my-model
    jaxspec-convert smollm2-135m converted/smollm2-bf16 --dtype bfloat16
    jaxspec-convert model.gguf converted/model --force

`python scripts/convert.py ...` runs the same. SRC is an HF folder, a .gguf file or a catalogue name. OUT gets
config.json, jaxspec.json (the marker), the tokenizer files, generation_config.json if any, and params/ (an orbax
checkpoint); see jaxspec.checkpoint. OUT is written into a temporary sibling and renamed into place only when
complete. An existing OUT is replaced only with --force, and only if it is itself a conversion folder.

Mistakes (a missing or damaged SRC, an OUT that exists) print one line `error: ...` and exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="HF folder, .gguf file or catalogue name")
    p.add_argument("out", help="conversion folder to write")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="param dtype stored in OUT (default float32; jaxspec.load(OUT, dtype=...) can cast)")
    p.add_argument("--force", action="store_true", help="replace an existing conversion folder at OUT")
    p.add_argument("--quiet", action="store_true", help="no per-tensor progress")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError, FileExistsError) as error:
        # A user mistake or a damaged checkpoint (jaxspec names the file and the problem): one line, no traceback.
        print(f"error: {error}", file=sys.stderr)
        return 2


def run(args) -> int:
    from jaxspec import checkpoint, loading

    checkpoint.check_replaceable(args.out, args.force)
    start = time.perf_counter()
    model = loading.convert(args.src, args.dtype, progress=not args.quiet)
    out = checkpoint.save(model, args.out, force=args.force)
    if not args.quiet:
        print(f"wrote {out} ({args.dtype}) in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
