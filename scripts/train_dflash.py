"""Shim for `jaxspec-train-dflash` (jaxspec/cli/train_dflash.py), so that `python scripts/train_dflash.py ...` works
too."""

import sys

from jaxspec.cli.train_dflash import main

if __name__ == "__main__":
    sys.exit(main())
