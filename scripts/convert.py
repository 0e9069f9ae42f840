"""Shim for `jaxspec-convert` (jaxspec/cli/convert.py), so that `python scripts/convert.py ...` keeps working."""

import sys

from jaxspec.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
