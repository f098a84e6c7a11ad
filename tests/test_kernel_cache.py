"""kernels/cache_check.py: cached kernels compiled from other sources are dropped, not run.

numba keys a cached kernel on its own file's timestamp only; the fused layer inlines code from
five other files, so after an edit or an upgrade of those it would load the OLD machine code.
Red on: a fingerprint that ignores some kernel source (the sweep below names every module with
a cached kernel), a drop that keeps the files, a missing marker counted as fresh."""

from dflash2_numba.kernels import cache_check


def _fake_cache(d, n=3):
    for i in range(n):
        (d / f"k{i}.nbi").write_bytes(b"index")
        (d / f"k{i}.nbc").write_bytes(b"data")


def test_stale_directory_is_emptied_and_marked(tmp_path):
    _fake_cache(tmp_path)
    (tmp_path / "other.pyc").write_bytes(b"x")  # not numba's: kept
    (tmp_path / cache_check.FINGERPRINT_FILE).write_text("an older build\n")
    assert cache_check.drop_stale_kernels(tmp_path, "abc") == 6
    assert not list(tmp_path.glob("*.nb[ic]")) and (tmp_path / "other.pyc").exists()
    assert (tmp_path / cache_check.FINGERPRINT_FILE).read_text().strip() == "abc"
    _fake_cache(tmp_path)  # compiled again by this build: kept from now on
    assert cache_check.drop_stale_kernels(tmp_path, "abc") == 0
    assert len(list(tmp_path.glob("*.nb[ic]"))) == 6


def test_unmarked_directory_counts_as_stale(tmp_path):
    _fake_cache(tmp_path, 2)
    assert cache_check.drop_stale_kernels(tmp_path, "abc") == 4


def test_fingerprint_covers_every_module_with_a_cached_kernel():
    """Every module that defines a cached dispatcher is one of the fingerprinted sources, and so
    are the files whose helpers are inlined into them (numerics, rowwise)."""
    from pathlib import Path

    pkg = cache_check.PACKAGE
    files = sorted(p for pattern in cache_check.KERNEL_SOURCES for p in pkg.glob(pattern))
    for d in cache_check._cached_dispatchers(cache_check._kernel_modules()):
        assert Path(d.py_func.__code__.co_filename).resolve() in files, d.py_func.__qualname__
    assert any(p.name == "numerics.py" for p in files) and any(p.name == "rowwise.py" for p in files)
