"""Shim for `jaxspec-train-eagle3` (jaxspec/cli/train_eagle3.py), so that `python scripts/train_eagle3.py ...` works
too."""

import sys

from jaxspec.cli.train_eagle3 import main

if __name__ == "__main__":
    sys.exit(main())
