"""The settings table (common/settings.py) as the commands read it: types checked by pydantic, one
line for a malformed variable, real booleans, and old names that keep working with a warning."""

from __future__ import annotations

import argparse
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


# -- commands that share a service's setting read its variable, and their flag wins --------------------

# The commands that start services or run the engine, and their flags that are not the service setting
# of the same name (another meaning): the tokens to generate, llama.cpp's threads, the first stack's
# port, how many drafter replicas.
ENGINE_COMMANDS = ("generate", "bench", "stack", "soak", "bench-stack", "bench-batch", "bench-burst")
ENGINE_COMMANDS += ("bench-corpus", "bench-tools", "bench-llama-cpp", "prior")
OTHER_MEANING = {"--max-new-tokens", "bench-llama-cpp --threads", "bench-burst --http-port", "bench-corpus --drafters"}


def _subparser(name: str):
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _shared_flags(command: str) -> list[tuple[str, settings.Setting]]:
    """(flag, setting) for each flag of ``command`` named like a service setting."""
    table = {s.flag: s for service in settings.PORTS for s in settings.settings_of(service)}
    out = []
    for action in _subparser(command)._actions:
        flag = next((f for f in action.option_strings if f in table), None)
        if flag and flag not in OTHER_MEANING and f"{command} {flag}" not in OTHER_MEANING:
            out.append((flag, table[flag]))
    return out


def _another_value(s: settings.Setting, now: object) -> str:
    """A valid value of ``s`` other than ``now``, as a flag or a variable spells it."""
    if s.choices:
        return next(c for c in s.choices if c != now)
    if s.type is bool:
        return "0" if now else "1"
    if s.type in (int, float):
        return str(int(now or 0) + 3)
    return f"{now}-elsewhere" if now else "elsewhere"  # (not "-elsewhere": a flag to argparse)


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_a_commands_flag_for_a_service_setting_reads_its_variable_and_the_flag_wins(command, monkeypatch):
    shared = _shared_flags(command)
    assert shared or command == "bench-llama-cpp", f"racer {command} shares no setting"
    for name in list(os.environ):
        if name.startswith("RACER_"):
            monkeypatch.delenv(name)
    for flag, s in shared:
        dest = flag.removeprefix("--").replace("-", "_")
        fallback = getattr(parser().parse_args([command]), dest)  # neither flag nor variable: its default
        from_env = _another_value(s, fallback)
        monkeypatch.setenv(s.env, from_env)
        assert getattr(parser().parse_args([command]), dest) == s.parse(from_env, s.env), f"{command} {flag}"
        from_flag = _another_value(s, s.parse(from_env, s.env))
        assert getattr(parser().parse_args([command, flag, from_flag]), dest) == s.parse(from_flag, flag)
        monkeypatch.delenv(s.env)


def test_without_flag_or_variable_a_command_has_the_tables_default_or_its_own(monkeypatch):
    for name in list(os.environ):
        if name.startswith("RACER_"):
            monkeypatch.delenv(name)
    args = parser().parse_args(["stack"])
    assert (args.dtype, args.model) == (
        settings.default("verifier", "--dtype"),
        settings.default("verifier", "--model"),
    )
    assert (args.log_level, args.http_port) == ("WARNING", 8000)  # the stack's own: quiet, its HTTP API on
    assert parser().parse_args(["bench"]).threads == settings.default("verifier", "--threads")


def test_a_malformed_variable_of_a_commands_flag_is_one_line(monkeypatch, capsys, no_start):
    monkeypatch.setenv("RACER_DTYPE", "float64")
    assert main(["stack", "--no-pin"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["racer: RACER_DTYPE='float64': expected one of float32, bfloat16, float16, gguf, auto"]


@pytest.fixture
def stack_environments(monkeypatch):
    """``racer stack``'s services' environments, as the command would start them (nothing starts)."""
    got: dict[str, dict[str, str]] = {}

    def start_healthy(procs, envs, targets=None):
        got.update(envs)
        raise KeyboardInterrupt  # stops the command here; nothing was started

    monkeypatch.setattr(stack, "start_healthy", start_healthy)
    monkeypatch.setattr("verifier.model.resolve_model_dir", lambda model: None)
    for name in list(os.environ):
        if name.startswith("RACER_"):
            monkeypatch.delenv(name)

    def run(*argv: str) -> dict[str, dict[str, str]]:
        got.clear()
        with pytest.raises(KeyboardInterrupt):
            main(["stack", "--no-pin", *argv])
        return got

    return run


def test_racer_stack_serves_the_dtype_of_racer_dtype_and_a_flag_wins(stack_environments, monkeypatch):
    assert stack_environments()["verifier"]["RACER_DTYPE"] == "auto"
    monkeypatch.setenv("RACER_DTYPE", "float32")
    monkeypatch.setenv("RACER_LOG_LEVEL", "INFO")
    envs = stack_environments()
    assert {s: e["RACER_DTYPE"] for s, e in envs.items()} == dict.fromkeys(
        ("gateway", "drafter", "verifier"), "float32"
    )
    assert envs["verifier"]["RACER_LOG_LEVEL"] == "INFO"
    envs = stack_environments("--dtype", "bfloat16", "--log-level", "ERROR")
    assert (envs["verifier"]["RACER_DTYPE"], envs["verifier"]["RACER_LOG_LEVEL"]) == ("bfloat16", "ERROR")


def test_racer_stack_serves_the_model_of_racer_model_and_a_flag_wins(stack_environments, monkeypatch, tmp_path):
    monkeypatch.setenv("RACER_MODEL", str(tmp_path / "from-env"))
    assert stack_environments()["verifier"]["RACER_MODEL"] == str(tmp_path / "from-env")
    assert stack_environments("--model", str(tmp_path / "flag"))["gateway"]["RACER_MODEL"] == str(tmp_path / "flag")


def test_racer_stack_gives_its_gateway_the_chat_template_of_the_flag_or_variable(stack_environments, monkeypatch):
    assert "RACER_CHAT_TEMPLATE" not in stack_environments()["gateway"]
    assert stack_environments("--chat-template", "flag.jinja")["gateway"]["RACER_CHAT_TEMPLATE"] == "flag.jinja"
    monkeypatch.setenv("RACER_CHAT_TEMPLATE", "env.jinja")
    assert stack_environments()["gateway"]["RACER_CHAT_TEMPLATE"] == "env.jinja"


def test_racer_soak_gives_its_services_racer_dtype_and_a_flag_wins(monkeypatch):
    from racer.soak import shared_settings

    monkeypatch.setenv("RACER_DTYPE", "float32")
    monkeypatch.delenv("RACER_MODEL", raising=False)
    assert shared_settings(parser().parse_args(["soak"]), "t")["RACER_DTYPE"] == "float32"
    assert shared_settings(parser().parse_args(["soak", "--dtype", "gguf"]), "t")["RACER_DTYPE"] == "gguf"
