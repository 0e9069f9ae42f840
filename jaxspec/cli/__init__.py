"""jaxspec's command-line entry points (`jaxspec-generate`, `jaxspec-convert`, `jaxspec-train-mtp`,
`jaxspec-train-dflash`, `jaxspec-plan`)."""
