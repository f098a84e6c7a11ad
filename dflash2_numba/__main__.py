"""`python -m dflash2_numba ...` is the `dflash2-decode` CLI."""

from .cli import main

main(prog_name="dflash2-decode")
