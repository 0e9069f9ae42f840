"""Shim for `jaxspec-plan` (jaxspec/cli/plan.py), so that `python scripts/plan.py ...` keeps working."""

import sys

from jaxspec.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
