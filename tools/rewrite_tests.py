"""Writes pytest's cache of rewritten test modules before a parallel run, without importing them.

pytest rewrites the asserts of every test module and ``conftest.py`` it imports, and caches the result beside the
module (``__pycache__/<name>.<tag>-pytest-<version>.pyc``, keyed by the source's hash). Where
``PYTHONDONTWRITEBYTECODE`` is set (as on many CI machines) it reads that cache but never writes it, so each
pytest-xdist worker rewrites every module again. ``make test`` runs this first::

    python tools/rewrite_tests.py tests

It rewrites on every CPU at once and imports nothing it rewrites (a collection would import torch, the Kubernetes
client and every test module, 10 s before the first test where this takes 3). An entry already up to date is
left alone. A module that does not parse is named on stderr and skipped: the test run reports it as it always
would. With a pytest whose internals differ, the tool writes nothing and says so, and the workers rewrite as they
did without it: a slower run, never a different one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def modules(roots: Iterable[Path]) -> list[Path]:
    """The files pytest rewrites under ``roots`` with this project's settings (the default ``python_files``)."""
    found: set[Path] = set()
    for given in roots:
        root = Path(os.path.abspath(given))  # pytest names a module by its absolute path, symbolic links kept
        for pattern in ("test_*.py", "*_test.py", "conftest.py"):
            found.update(p for p in root.rglob(pattern) if "__pycache__" not in p.parts)
    return sorted(found)


def rewrite(path: Path) -> str:
    """Write ``path``'s cache entry unless it is up to date: ``written``, ``current``, or why not."""
    try:
        from _pytest.assertion import rewrite as pytest_rewrite
    except ImportError as e:  # no pytest here: nothing to cache for
        return f"not written: {e}"
    cache_dir = pytest_rewrite.get_cache_dir(path)
    if not pytest_rewrite.try_makedirs(cache_dir):
        return f"not written: {cache_dir} cannot be created"
    pyc = cache_dir / (path.name[:-3] + pytest_rewrite.PYC_TAIL)
    if pytest_rewrite._read_pyc(path, pyc) is not None:
        return "current"
    try:
        # No config: what it would change is the assertion-pass hook, off unless an ini file turns it on.
        source_hash, code = pytest_rewrite._rewrite_test(path, None)  # type: ignore[arg-type]
    except SyntaxError as e:
        return f"not written: {e}"
    partial = pyc.with_name(f"{pyc.name}.{os.getpid()}")
    with open(partial, "wb") as fp:
        pytest_rewrite._write_pyc_fp(fp, source_hash, code)
    os.replace(partial, pyc)  # a reader sees the old entry or the whole new one, as pytest's own writes
    return "written"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", type=Path, help="directories of tests")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes at once (default: one per CPU)")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.roots if not r.is_dir()]
    if missing:
        parser.error(f"roots: not a directory: {', '.join(missing)}")
    if args.jobs < 1:
        parser.error(f"--jobs: expected a positive number of processes, got {args.jobs}")
    paths = modules(args.roots)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        outcomes = list(pool.map(rewrite, paths, chunksize=max(1, len(paths) // (4 * args.jobs))))
    counts: dict[str, int] = {}
    for path, outcome in zip(paths, outcomes, strict=True):
        kind = outcome if outcome in ("written", "current") else "skipped"
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "skipped":
            print(f"{path}: {outcome}", file=sys.stderr)
    print(", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "no test modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
