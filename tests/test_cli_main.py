"""The ``operate-sidecar`` command line as a user meets it: a common mistake (a config file that is
not TOML, a PID that is not one) is one clear line on stderr and exit code 2, never a traceback or
a server that starts and silently ignores the flag; ``--help`` names what it accepts."""

from __future__ import annotations

import sys

import pytest

from cli_support import cli, one_line_error  # tests/ is on sys.path
from operate_sidecar.server.rpc.settings import DEFAULTS

pytestmark = pytest.mark.timeout(60)




@pytest.mark.parametrize("content, why", [
    (b"x = [\n", "is not a TOML file: "),
    (b'{"models": {}}\n', "is not a TOML file: "),
    (b"\xff\xfe m = 1\n", "is not a TOML file: it is not UTF-8 text"),
])
def test_a_config_file_that_is_not_toml_is_named_as_such(tmp_path, content, why):
    (tmp_path / "settings.toml").write_bytes(content)
    line = one_line_error(cli("--config", "settings.toml", cwd=tmp_path))
    assert line.startswith("operate-sidecar: bad configuration: settings.toml " + why), line


OPENAI = '[models.m]\nprovider = "openai"\nbaseUrl = "http://127.0.0.1:9/v1"\nmodel = "x"\n'
NOT_JSON = "which no setting holds (settings are JSON values: write it as a quoted string)"


@pytest.mark.parametrize("content, why", [
    # (a date in a model's options went on to the provider's request: an internal error at the first operate)
    (OPENAI + "options = { when = 1979-05-27T07:32:00Z }\n",
     f"models.m.options.when is a TOML date-time (1979-05-27T07:32:00+00:00), {NOT_JSON}"),
    (OPENAI + 'options = { extraBody = { "my.key" = [1, { at = 07:32:00 }] } }\n',
     f'models.m.options.extraBody."my.key"[1].at is a TOML time (07:32:00), {NOT_JSON}'),
    ('[settings.models.m]\nprovider = "openai"\nbaseUrl = "http://127.0.0.1:9/v1"\nmodel = "x"\n'
     'options = { stop = ["a", 1979-05-27] }\n',
     f"models.m.options.stop[1] is a TOML date (1979-05-27), {NOT_JSON}"),
    (OPENAI + "options = { temperature = nan }\n",
     "models.m.options.temperature is nan, not a finite number (settings are JSON values)"),
    (OPENAI + "options = { seed = 1, n = -inf }\n",
     "models.m.options.n is -inf, not a finite number (settings are JSON values)"),
    # (deeper than the parser's recursion: a RecursionError's traceback; or deeper than the wire allows)
    ("a = " + "[" * 5000 + "]" * 5000 + "\n", "the settings are nested more than 32 levels deep"),
    ("[models.m]\nprovider = \"local\"\noptions = " + "{ a = " * 40 + "1" + " }" * 40 + "\n",
     "the settings are nested more than 32 levels deep"),
])
def test_a_config_value_that_json_cannot_hold_is_named_by_its_key(tmp_path, content, why):
    """The file's settings are those ``initialize`` may send: JSON values. TOML also has dates,
    times, NaN and infinities, and nests as deep as its parser recurses; each is refused at start
    with the key that holds it, never passed on to fail later, never a traceback. (In a field
    that is checked, the field's own check names it: test_settings_validation.py.)"""
    (tmp_path / "settings.toml").write_text(content)
    line = one_line_error(cli("--config", "settings.toml", cwd=tmp_path))
    assert line == "operate-sidecar: bad configuration: settings.toml: " + why, line


@pytest.mark.parametrize("path, why", [("missing.toml", "No such file or directory"), (".", "Is a directory")])
def test_a_config_file_that_cannot_be_read_is_one_plain_line(tmp_path, path, why):
    line = one_line_error(cli("--config", path, cwd=tmp_path))
    assert line == f"operate-sidecar: bad configuration: cannot read {path}: {why}", line


@pytest.mark.parametrize("pid", ["0", "-5", "abc"])
def test_a_client_process_id_that_is_no_process_id_is_refused(pid):
    # 0 names the server's own process group to kill(2): the watchdog never fired; a negative
    # number made the server exit at once, as if the client had died
    line = one_line_error(cli(f"--client-process-id={pid}"))
    assert line == f"operate-sidecar: error: argument --client-process-id: not a process id: {pid!r}" + (
        " (a PID is a positive integer)" if pid != "abc" else ""), line


def test_help_names_every_setting_a_config_file_may_hold():
    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr
    config_help = " ".join(proc.stdout.split("\n  --config FILE", 1)[1].split("\n  --state-dir", 1)[0].split())
    missing = [key for key in DEFAULTS if key not in config_help]
    assert not missing, (missing, config_help)


def test_version_prints_the_installed_version_on_stdout_and_starts_no_server():
    """``--version`` (what an editor's health check or a bug report asks first): the version the
    installed distribution has, the one ``initialize`` reports as ``serverInfo.version``."""
    import importlib.metadata

    import operate_sidecar
    from operate_sidecar.server import __version__

    proc = cli("--version")
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)
    installed = importlib.metadata.version("operate-sidecar")
    assert proc.stdout == f"operate-sidecar {installed}\n", proc.stdout
    assert __version__ == operate_sidecar.__version__ == installed


def test_an_empty_state_dir_is_refused_not_memory_only_in_silence(tmp_path):
    """``--state-dir "$STATE"`` with STATE unset (or ``stateDir = ""`` in the config file) gave a
    server that kept its branches in memory only, lost at exit with no word; ``--record ""`` was
    already refused. Now an empty state dir is refused the same way."""
    line = one_line_error(cli("--state-dir", ""))
    assert line.startswith("operate-sidecar: --state-dir: no folder name given"), line
    (tmp_path / "settings.toml").write_text('stateDir = ""\n')
    line = one_line_error(cli("--config", "settings.toml", cwd=tmp_path))
    assert line.startswith("operate-sidecar: bad configuration: stateDir must be a path (not empty)"), line


MIXED = ('defaultModel = "b"\n[settings]\nmaxBranches = 1\n'
         '[models.a]\nprovider = "scripted"\nresponses = ["x"]\n[models.b]\nprovider = "scripted"\nresponses = ["y"]\n')


@pytest.mark.parametrize("content", [
    # top-level keys and a [settings] table together: TOML puts [models.a] after [settings] back at the
    # top, so such a file is easily written; it was "unknown settings field(s): settings"
    MIXED.encode(),
    # a UTF-8 byte-order mark, as Windows editors write one: it was "Invalid statement (at line 1, column 1)"
    b"\xef\xbb\xbf" + MIXED.encode(),
    # the same settings all in the table
    MIXED.replace('defaultModel = "b"\n[settings]\n', '[settings]\ndefaultModel = "b"\n')
         .replace("[models.", "[settings.models.").encode(),
])
def test_a_config_file_may_mix_top_level_keys_and_a_settings_table_and_start_with_a_bom(tmp_path, content):
    from operate_sidecar.clients.python.client import RpcError, SidecarClient

    (tmp_path / "settings.toml").write_bytes(content)
    with open(tmp_path / "stderr.txt", "wb") as err, SidecarClient(
            [sys.executable, "-m", "operate_sidecar.server", "--config", "settings.toml"], cwd=str(tmp_path),
            stderr=err) as c:
        assert c.request("initialize", {}, timeout=30)["capabilities"]["models"] == ["a", "b"]
        c.request("createBranch", {}, timeout=30)
        (branch,) = c.request("listBranches", {}, timeout=30)["branches"]
        assert branch["chatModel"] == "b"  # the top-level key
        with pytest.raises(RpcError) as e:  # the table's key
            c.request("createBranch", {}, timeout=30)
        assert "maxBranches" in e.value.message, e.value.message
    assert "bad configuration" not in (tmp_path / "stderr.txt").read_text()


def test_a_setting_given_both_at_the_top_level_and_in_the_settings_table_is_named(tmp_path):
    (tmp_path / "settings.toml").write_text('maxBranches = 3\ndefaultModel = "a"\n[settings]\nmaxBranches = 5\n'
                                            'defaultModel = "a"\n')
    line = one_line_error(cli("--config", "settings.toml", cwd=tmp_path))
    assert line == ("operate-sidecar: bad configuration: settings.toml: maxBranches, defaultModel are set both at "
                    "the top level and in the [settings] table; set each setting once"), line


def test_a_misspelt_default_model_in_the_config_file_names_the_closest_one(tmp_path):
    (tmp_path / "settings.toml").write_text('defaultModel = "gtp"\n[models.gpt]\nprovider = "scripted"\n'
                                            'responses = ["x"]\n')
    line = one_line_error(cli("--config", "settings.toml", cwd=tmp_path))
    assert line == ("operate-sidecar: bad configuration: defaultModel 'gtp' is not a configured model "
                    "(did you mean 'gpt'?)"), line
