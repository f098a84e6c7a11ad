"""Import a script of bench/ as a module (bench/ is not a package), for the tests of its pieces."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(filename: str, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, BENCH / filename)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
