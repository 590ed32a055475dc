"""The command line's first words: ``--version`` and a bad ``--log-level`` answered plainly (issue 35), through
the installed ``stalwart`` program."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from importlib.metadata import version

import pytest

from stalwart.cli import LOG_LEVELS, JsonFormatter, build_parser, subcommands


def stalwart(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stalwart", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_version_is_the_installed_distributions() -> None:
    done = stalwart("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"stalwart {version('stalwart')}")


@pytest.mark.parametrize("bad", ["foo", "verbose", ""])
def test_a_bad_log_level_is_a_usage_error_naming_the_choices(bad: str) -> None:
    done = stalwart("--log-level", bad, "crd")
    assert done.returncode == 2 and done.stdout == ""
    assert f"argument --log-level: expected one of {', '.join(LOG_LEVELS)} (any case), got {bad!r}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_log_level_in_any_case_is_taken() -> None:
    assert build_parser().parse_args(["--log-level", "debug", "crd"]).log_level == "DEBUG"
    done = stalwart("--log-level", "warning", "crd")
    assert done.returncode == 0 and "CustomResourceDefinition" in done.stdout


def test_every_command_and_action_has_help_and_a_description() -> None:
    commands = subcommands(build_parser())
    assert {"crd", "local up", "local status", "operator", "agent", "drill", "demo"} <= set(commands)
    for name, (parser, help_) in commands.items():
        assert help_, f"stalwart {name}: no help in its parent's list"
        assert parser.description, f"stalwart {name}: no description in its own --help"
        assert " ".join(parser.description.split()) in " ".join(parser.format_help().split()), name


def test_log_format_json_writes_one_object_per_line() -> None:
    done = stalwart("--log-format", "json", "operator", "--concurrency", "0")
    records = [json.loads(line) for line in done.stderr.splitlines()]  # every line is one object
    assert done.returncode == 2
    assert {"level": "ERROR", "logger": "stalwart.cli.operator", "message": "--concurrency: must be >= 1, got 0"
            }.items() <= records[0].items()
    record = JsonFormatter().format(logging.LogRecord("stalwart.agent", logging.WARNING, __file__, 1,
                                                      "job=ns/j node=n: %s", ("lost",), None))
    parsed = json.loads(record)
    assert parsed["level"] == "WARNING" and parsed["logger"] == "stalwart.agent"
    assert parsed["message"] == "job=ns/j node=n: lost" and parsed["time"].endswith("Z")
    bad = stalwart("--log-format", "xml", "crd")
    assert bad.returncode == 2 and "argument --log-format: invalid choice: 'xml'" in bad.stderr
