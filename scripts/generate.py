"""Generate text from the command line: the `jaxspec-generate` program (jaxspec/cli/generate.py; `--help`)."""

import sys

from jaxspec.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
