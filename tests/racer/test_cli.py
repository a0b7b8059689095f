"""Every ``racer`` command runs a function that exists: a moved or renamed module cannot leave a
command behind (they are named as strings, imported when the command runs)."""

from __future__ import annotations

import importlib

import pytest

from racer.cli import BENCH_CORPUS, COMMANDS


def targets() -> list[tuple[str, str, str]]:
    out = [(c.name, *c.run.split(":")) for c in COMMANDS if not callable(c.run)]
    return out + [(f"bench-corpus --through {k}", m, "main") for k, m in BENCH_CORPUS.items()]


def resolves(module: str, function: str) -> bool:
    return callable(getattr(importlib.import_module(module), function, None))


@pytest.mark.parametrize(("command", "module", "function"), targets())
def test_every_command_names_a_function_that_exists(command, module, function):
    assert resolves(module, function), f"racer {command}: {module}:{function}"


def test_a_command_of_the_benchmarks_left_out_says_so(monkeypatch, capsys):
    """The serving image leaves racer/bench out: its commands end with one line, not a traceback."""
    from racer import cli

    gone = cli.Command("bench", "", lambda p: None, "racer.bench.not_installed:main")
    monkeypatch.setattr(cli, "COMMANDS", (gone,))
    assert cli.main(["bench"]) == 2
    assert "racer: bench: the benchmarks (racer/bench) are not installed here" in capsys.readouterr().err


def test_a_missing_function_is_caught():
    assert ("load", "racer.bench.loadgen", "main") in targets()
    assert not resolves("racer.bench.loadgen", "mian")
