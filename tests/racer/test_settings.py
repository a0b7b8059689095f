"""The settings table (common/settings.py) as the commands read it: types checked by pydantic, one
line for a malformed variable, real booleans, and old names that keep working with a warning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common import settings
from racer import launch, stack
from racer.cli import main, parser


@pytest.fixture
def no_start(monkeypatch):
    """``racer stack`` must refuse before it starts any process or converts any model."""

    def refuse(*a, **k):
        raise AssertionError("started something despite a malformed setting")

    monkeypatch.setattr(stack, "_spawn", refuse)
    monkeypatch.setattr("verifier.model.resolve_model_dir", refuse)


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        (["serve", "verifier"], {"RACER_PORT": "abc"}, "RACER_PORT='abc': expected an integer"),
        (["serve", "drafter"], {"RACER_SESSION_TTL": "soon"}, "RACER_SESSION_TTL='soon': expected a number"),
        (["serve", "gateway"], {"RACER_MAX_BUDGET": "1.5"}, "RACER_MAX_BUDGET='1.5': expected an integer"),
        (["serve", "verifier"], {"RACER_MEASURE_COST": "maybe"}, "RACER_MEASURE_COST='maybe': expected a boolean"),
        (["serve", "verifier"], {"RACER_BACKEND": "lean"}, "RACER_BACKEND='lean': expected one of auto, llama, hf"),
        (["stack", "--no-pin"], {"RACER_MAX_BATCH": "many"}, "RACER_MAX_BATCH='many': expected an integer"),
        (["client", "sessions"], {"RACER_LOG": "LOUD"}, "RACER_LOG='LOUD': expected a logging level"),
    ],
)
def test_a_malformed_variable_is_one_line_naming_it_and_exit_2(argv, env, expected, monkeypatch, capsys, no_start):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"racer: {expected}"), err


def test_a_malformed_variable_without_a_traceback_from_the_real_command():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACER_")} | {"RACER_PORT": "abc"}
    proc = subprocess.run(
        [sys.executable, "-m", "racer.cli", "serve", "verifier"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["racer: RACER_PORT='abc': expected an integer"]


def test_a_command_that_does_not_read_a_variable_is_not_stopped_by_it(monkeypatch):
    monkeypatch.setenv("RACER_PORT", "abc")
    args = parser().parse_args(["client", "sessions"])  # a client reads no RACER_PORT
    assert args.target == "localhost:50051"


def test_a_malformed_flag_names_the_flag_and_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["serve", "verifier", "--max-batch", "lots"])
    assert e.value.code == 2
    assert "argument --max-batch: 'lots': expected an integer" in capsys.readouterr().err


def test_booleans_are_booleans():
    for raw, want in (("1", True), ("0", False), ("true", True), ("no", False), ("on", True)):
        ns = settings.parse("verifier", environ={"RACER_ALLOW_UNAUTHENTICATED": raw, "RACER_MEASURE_COST": raw})
        assert ns.allow_unauthenticated is want and ns.measure_cost is want
    assert settings.parse("drafter", ["--allow-unauthenticated"], environ={}).allow_unauthenticated is True
    assert settings.parse("drafter", ["--allow-unauthenticated", "0"], environ={}).allow_unauthenticated is False
    assert settings.parse("drafter", environ={}).allow_unauthenticated is False


def test_a_flag_wins_over_its_variable_which_wins_over_the_table():
    env = {"RACER_MAX_BATCH": "3"}
    assert settings.parse("verifier", ["--max-batch", "5"], environ=env).max_batch == 5
    assert settings.parse("verifier", environ=env).max_batch == 3
    assert settings.parse("verifier", environ={}).max_batch == settings.default("verifier", "--max-batch") == 16


def test_launch_defaults_are_the_table(monkeypatch):
    for name in list(os.environ):
        if name.startswith("RACER_"):
            monkeypatch.delenv(name)
    for service in settings.PORTS:
        ns = launch.defaults(service)
        assert {s.dest: s.default for s in settings.settings_of(service)} == vars(ns)
    with pytest.raises(TypeError, match="unknown setting"):
        launch.defaults("drafter", kv_memory_bytes=1)  # a verifier setting


def test_the_table_has_one_flag_and_one_variable_per_setting():
    for service in settings.PORTS:
        table = settings.settings_of(service)
        names = [f for s in table for f in (s.flag, *s.old_flags)]
        envs = [e for s in table for e in (s.env, *s.old_envs)]
        assert len(names) == len(set(names)) and len(envs) == len(set(envs)), service
        for s in table:
            assert s.env == "RACER_" + s.dest.upper(), s.flag  # the variable is the flag's name
            assert isinstance(s.default, s.type), s.flag  # the default is a value of its type


@pytest.mark.parametrize(("old", "new"), [("fast", "llama"), ("generic", "hf")])
def test_the_old_backend_values_are_the_new_ones_with_a_warning(old, new):
    """The flag, the variable and the in-process commands take the names ``make_backend`` takes."""
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated: use '{new}'"):
        assert settings.parse("verifier", ["--backend", old], environ={}).backend == new
    with pytest.warns(DeprecationWarning, match=f"RACER_BACKEND '{old}' is deprecated"):
        assert settings.parse("verifier", environ={"RACER_BACKEND": old}).backend == new
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated"):  # the in-process commands' flag too
        assert parser().parse_args(["generate", "--backend", old]).backend == new
    assert settings.parse("verifier", ["--backend", new], environ={}).backend == new


def test_the_kv_memory_flag_and_variable_keep_their_old_budget_names(recwarn):
    with pytest.warns(DeprecationWarning, match="--kv-budget-bytes is deprecated: use --kv-memory-bytes"):
        assert settings.parse("verifier", ["--kv-budget-bytes", "7"], environ={}).kv_memory_bytes == 7
    with pytest.warns(DeprecationWarning, match="RACER_KV_BUDGET_BYTES is deprecated: use RACER_KV_MEMORY_BYTES"):
        assert settings.parse("verifier", environ={"RACER_KV_BUDGET_BYTES": "9"}).kv_memory_bytes == 9
    recwarn.clear()
    both = {"RACER_KV_BUDGET_BYTES": "9", "RACER_KV_MEMORY_BYTES": "11"}
    assert settings.parse("verifier", environ=both).kv_memory_bytes == 11  # the new name wins, silently
    assert settings.parse("verifier", ["--kv-memory-bytes", "5"], environ={}).kv_memory_bytes == 5
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_a_stack_whose_key_file_holds_no_key_says_so_before_it_starts(tmp_path, monkeypatch, capsys, no_start):
    keys = tmp_path / "keys.txt"
    keys.write_text("# nobody yet\n")
    monkeypatch.setenv("RACER_API_KEYS", str(keys))
    assert main(["stack", "--no-pin"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"racer: RACER_API_KEYS={keys}: the file holds no 'key tenant' line, so every call would be refused"
    ]


def test_the_stack_with_api_keys_answers_with_a_key_of_the_file_and_says_how_clients_authenticate(tmp_path, tiny_llama):
    from tests.support.tinytok import make_char_tokenizer

    model = tmp_path / "model"
    tiny_llama.save_pretrained(model)
    make_char_tokenizer().save_pretrained(model)
    keys = tmp_path / "keys.txt"
    secret = "sk-acme-0123456789abcdef"
    keys.write_text(f"{secret} acme\nsk-globex-0123456789 globex\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACER_")}
    env.update(RACER_API_KEYS=str(keys), RACER_THREADS="1", RACER_MEASURE_COST="0", OMP_NUM_THREADS="1")
    argv = ["stack", "Hi", "--model", str(model), "--max-new-tokens", "6", "--budget", "4", "--no-pin"]
    argv += ["--any-ports", "--http-port", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "racer.cli", *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UNAUTHENTICATED" not in proc.stderr
    assert " tokens=" in proc.stderr and "session=" in proc.stderr  # the stack's own answer came back
    assert f"with a key of {keys}" in proc.stderr and "use tenant acme's key" in proc.stderr
    assert secret not in proc.stderr + proc.stdout  # it says which key, never the key
