"""Shim for `jaxspec-train-mtp` (jaxspec/cli/train_mtp.py), so that `python scripts/train_mtp.py ...` keeps working."""

import sys

from jaxspec.cli.train_mtp import main

if __name__ == "__main__":
    sys.exit(main())
