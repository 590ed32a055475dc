"""tools/rewrite_tests.py: the cache of rewritten test modules it writes is the one pytest writes itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "rewrite_tests.py"
TAG = f"{sys.implementation.cache_tag}-pytest-{pytest.__version__}.pyc"


def run(*args: str | Path, cwd: Path, write: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if not write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # as on CI: pytest reads its cache but never writes it
    # run() waits for the process (or kills it at the timeout and raises): each one ends here.
    return subprocess.run([sys.executable, *map(str, args)], check=False, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    root = tmp_path / "suite"
    (root / "sub").mkdir(parents=True)
    (root / "conftest.py").write_text("import pytest\n\n@pytest.fixture\ndef two():\n    assert 1 + 1 == 2\n"
                                      "    return 2\n")
    (root / "sub" / "test_sums.py").write_text("def test_sum(two):\n    assert two + 1 == 4\n")
    (root / "sub" / "helpers.py").write_text("def helper():\n    assert True\n")
    (root / "sub" / "test_broken.py").write_text("def test_broken(:\n")
    return root


def cached(module: Path) -> Path:
    return module.parent / "__pycache__" / f"{module.stem}.{TAG}"


def test_the_entries_are_pytests_own_and_a_module_that_does_not_parse_is_named(suite: Path) -> None:
    done = run(TOOL, suite, cwd=suite.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1 skipped, 2 written"
    assert "test_broken.py: not written:" in done.stderr
    modules = [suite / "conftest.py", suite / "sub" / "test_sums.py"]
    ours = {m: cached(m).read_bytes() for m in modules}
    assert not cached(suite / "sub" / "helpers.py").exists()  # not a test module: pytest does not rewrite it

    # pytest's own entries, written by a collection where writing is allowed, are the same bytes.
    for m in modules:
        cached(m).unlink()
    collected = run("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "sub/test_sums.py",
                    cwd=suite, write=True)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert {m: cached(m).read_bytes() for m in modules} == ours

    # Read where writing is off: the rewritten assert explains itself.
    failed = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "sub/test_sums.py", cwd=suite)
    assert failed.returncode == 1 and "assert (2 + 1) == 4" in failed.stdout, failed.stdout


def test_an_entry_that_is_current_is_left_alone_and_a_changed_module_is_rewritten(suite: Path) -> None:
    assert run(TOOL, suite / "sub", cwd=suite).returncode == 0
    module = suite / "sub" / "test_sums.py"
    before = cached(module).stat().st_mtime_ns
    again = run(TOOL, suite / "sub", cwd=suite)
    assert again.stdout.strip() == "1 current, 1 skipped"
    assert cached(module).stat().st_mtime_ns == before
    module.write_text("def test_sum():\n    assert 3 == 3\n")
    changed = run(TOOL, suite / "sub", cwd=suite)
    assert changed.stdout.strip() == "1 skipped, 1 written"


@pytest.mark.parametrize(("args", "named"), [
    (["nowhere"], "roots: not a directory: nowhere"),
    (["-j", "0", "."], "--jobs: expected a positive number of processes, got 0"),
])
def test_bad_arguments_are_named(args: list[str], named: str, tmp_path: Path) -> None:
    done = run(TOOL, *args, cwd=tmp_path)
    assert done.returncode == 2 and named in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []
