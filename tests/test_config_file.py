"""swarm.config_file: precedence command line > RAVN_* environment > config file > defaults, and clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from coordinator.options import RunOptions, with_train_options
from swarm.config_file import (
    enable_config,
    read_join_file,
    remove_join_file,
    section_defaults,
    write_join_file,
)


def make_app(default_file: Path | None = None) -> typer.Typer:
    """A tiny two-command program shaped like ravn-peer / ravn-coordinator."""
    app = typer.Typer(add_completion=False)

    @app.callback()
    def _main() -> None:
        """A test program."""

    @app.command()
    def join(
        swarm: Annotated[str, typer.Option(envvar="RAVN_SWARM")] = "",
        initial_peers: Annotated[list[str] | None, typer.Option()] = None,
        port: Annotated[int, typer.Option(min=0, max=65535)] = 0,
        host: str = "127.0.0.1",
        verbose: bool = False,
        key_file: Path | None = None,
        coordinator_key: str = "",
    ) -> None:
        typer.echo(
            json.dumps(
                {
                    "swarm": swarm,
                    "initial_peers": initial_peers,
                    "port": port,
                    "host": host,
                    "verbose": verbose,
                    "key_file": str(key_file) if key_file else None,
                    "coordinator_key": coordinator_key,
                }
            )
        )

    @app.command()
    @with_train_options
    def serve(options: RunOptions, port: int = 31337, peers: int = 3) -> None:
        typer.echo(
            json.dumps(
                {
                    "port": port,
                    "peers": peers,
                    "steps": options.steps,
                    "model": options.model,
                    "activation_checkpointing": options.activation_checkpointing,
                }
            )
        )

    return enable_config(app, sections={"join": "peer.join", "serve": "coordinator.serve"}, default_file=default_file)


@pytest.fixture(autouse=True)
def _no_ravn_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("RAVN_"):
            monkeypatch.delenv(key)


def run(args: list[str], env: dict[str, str] | None = None, app: typer.Typer | None = None) -> dict:
    result = CliRunner().invoke(app or make_app(), args, env=env or {})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def fail(args: list[str], env: dict[str, str] | None = None, app: typer.Typer | None = None) -> str:
    result = CliRunner().invoke(app or make_app(), args, env=env or {})
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, no usage box, no traceback
    assert lines[0].startswith("error: ")
    return lines[0]


def write(tmp_path: Path, text: str, name: str = "ravn.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


CONFIG = """
port = 1000                # flat: every command that has --port
swarm = "flat-swarm"       # flat: only join has it; serve ignores it

[peer]
host = "10.0.0.1"          # a parent table: commands under [peer.*]

[peer.join]
port = 2000
initial-peers = ["/ip4/1.2.3.4/tcp/31338/p2p/A", "/ip4/5.6.7.8/tcp/31338/p2p/B"]
verbose = true
key-file = "/keys/c.pem"

[coordinator.serve]
steps = 42
model = "gpt-tiny"
activation_checkpointing = true

[local]                    # another program's table: skipped
peers = 9
"""


def test_built_in_defaults_without_any_config() -> None:
    assert run(["join"]) == {
        "swarm": "",
        "initial_peers": None,
        "port": 0,
        "host": "127.0.0.1",
        "verbose": False,
        "key_file": None,
        "coordinator_key": "",
    }


def test_file_sections_flat_keys_and_parent_tables(tmp_path: Path) -> None:
    cfg = str(write(tmp_path, CONFIG))
    joined = run(["join", "--config", cfg])
    assert joined["port"] == 2000  # [peer.join] beats the flat key
    assert joined["key_file"] == "/keys/c.pem"
    assert joined["swarm"] == "flat-swarm" and joined["host"] == "10.0.0.1" and joined["verbose"] is True
    assert joined["initial_peers"] == ["/ip4/1.2.3.4/tcp/31338/p2p/A", "/ip4/5.6.7.8/tcp/31338/p2p/B"]
    served = run(["serve", "--config", cfg])
    assert served == {"port": 1000, "peers": 3, "steps": 42, "model": "gpt-tiny", "activation_checkpointing": True}


def test_precedence_command_line_over_env_over_file_over_default(tmp_path: Path) -> None:
    cfg = str(write(tmp_path, CONFIG))
    assert run(["join", "--config", cfg])["port"] == 2000
    assert run(["join", "--config", cfg], env={"RAVN_PORT": "3000"})["port"] == 3000
    assert run(["join", "--config", cfg, "--port", "4000"], env={"RAVN_PORT": "3000"})["port"] == 4000
    assert run(["serve", "--config", cfg], env={"RAVN_STEPS": "7"})["steps"] == 7
    assert run(["serve", "--config", cfg, "--steps", "8"], env={"RAVN_STEPS": "7"})["steps"] == 8
    assert run(["serve", "--config", cfg, "--no-activation-checkpointing"])["activation_checkpointing"] is False
    # an option's own envvar (RAVN_SWARM) and the automatic one agree on the name
    assert run(["join", "--config", cfg], env={"RAVN_SWARM": "env-swarm"})["swarm"] == "env-swarm"


def test_env_lists_split_on_whitespace() -> None:
    out = run(["join"], env={"RAVN_INITIAL_PEERS": "/ip4/1.1.1.1/tcp/1/p2p/A /ip4/2.2.2.2/tcp/2/p2p/B"})
    assert out["initial_peers"] == ["/ip4/1.1.1.1/tcp/1/p2p/A", "/ip4/2.2.2.2/tcp/2/p2p/B"]


def test_config_path_from_env_and_default_file(tmp_path: Path) -> None:
    a = write(tmp_path, "port = 11", "a.toml")
    b = write(tmp_path, "port = 22", "b.toml")
    assert run(["join"], env={"RAVN_CONFIG": str(a)})["port"] == 11
    assert run(["join", "--config", str(b)], env={"RAVN_CONFIG": str(a)})["port"] == 22
    assert run(["join"], app=make_app(default_file=b))["port"] == 22
    assert run(["join"], app=make_app(default_file=tmp_path / "absent.toml"))["port"] == 0  # a missing default is fine
    assert run(["join"], env={"RAVN_CONFIG": str(a)}, app=make_app(default_file=b))["port"] == 11


def test_single_string_for_a_list_option(tmp_path: Path) -> None:
    cfg = write(tmp_path, 'initial_peers = "/ip4/1.2.3.4/tcp/1/p2p/A"')
    assert run(["join", "--config", str(cfg)])["initial_peers"] == ["/ip4/1.2.3.4/tcp/1/p2p/A"]


def test_bad_toml_is_one_line(tmp_path: Path) -> None:
    cfg = write(tmp_path, "port = \n[peer.join")
    line = fail(["join", "--config", str(cfg)])
    assert f"config file {cfg} is not valid TOML" in line and "line 1" in line


def test_unknown_key_is_one_line_with_a_suggestion(tmp_path: Path) -> None:
    cfg = write(tmp_path, "[peer.join]\nprot = 1\n")
    assert fail(["join", "--config", str(cfg)]) == (
        f"error: config file {cfg}, [peer.join]: unknown key 'prot' (did you mean 'port'?)"
    )
    flat = write(tmp_path, "colour = 'blue'\n", "flat.toml")
    assert fail(["serve", "--config", str(flat)]) == f"error: config file {flat}: unknown key 'colour'"
    # a key of another command of this program is not allowed in this command's table
    wrong_table = write(tmp_path, "[coordinator.serve]\nswarm = 'x'\n", "wrong.toml")
    assert "[coordinator.serve]: unknown key 'swarm'" in fail(["serve", "--config", str(wrong_table)])


def test_unknown_table_under_our_own_tables(tmp_path: Path) -> None:
    cfg = write(tmp_path, "[peer.jion]\nport = 1\n")
    line = fail(["join", "--config", str(cfg)])
    assert "unknown table [peer.jion]" in line and "[peer.join]" in line


def test_wrong_type_and_missing_file(tmp_path: Path) -> None:
    cfg = write(tmp_path, "[peer.join]\nport = 'many'\n")
    line = fail(["join", "--config", str(cfg)])
    assert "port = 'many': " in line and "integer" in line
    big = write(tmp_path, "[peer.join]\nport = 70000\n", "big.toml")
    assert "port = 70000: " in fail(["join", "--config", str(big)])
    cfg = write(tmp_path, "[peer.join]\nhost = ['a', 'b']\n", "list.toml")
    assert "host takes one value, not a list" in fail(["join", "--config", str(cfg)])
    assert fail(["join", "--config", str(tmp_path / "nope.toml")]).endswith("nope.toml does not exist")
    assert "does not exist" in fail(["join"], env={"RAVN_CONFIG": str(tmp_path / "nope.toml")})


def test_help_lists_config_and_does_not_read_it(tmp_path: Path) -> None:
    cfg = write(tmp_path, "not toml at all [")
    result = CliRunner().invoke(make_app(), ["join", "--help"], env={"RAVN_CONFIG": str(cfg)})
    assert result.exit_code == 0 and "--config" in result.stdout and "RAVN_CONFIG" in result.stdout


def test_command_with_its_own_config_parameter_is_refused() -> None:
    app = typer.Typer()

    @app.command()
    def join(config: str = "") -> None:
        pass

    with pytest.raises(TypeError, match="declares a 'config' parameter"):
        enable_config(app)


def test_unknown_section_mapping_is_refused() -> None:
    app = typer.Typer()

    @app.command()
    def join() -> None:
        pass

    with pytest.raises(ValueError, match="sections name commands this app does not have: serve"):
        enable_config(app, sections={"serve": "coordinator.serve"})


def test_section_defaults_pure() -> None:
    sections = {"peer.join": frozenset({"port", "swarm"}), "peer.bench": frozenset({"seconds"})}
    data = {"swarm": "s", "seconds": 3, "peer": {"port": 5, "join": {"port": 6}}, "other": {"x": 1}}
    assert section_defaults(data, "peer.join", sections) == {"swarm": "s", "port": 6}
    assert section_defaults(data, "peer.bench", sections) == {"seconds": 3}


def test_join_file_round_trip_and_is_a_peer_config(tmp_path: Path) -> None:
    path = write_join_file(
        tmp_path / "shared" / "join.toml",
        swarm="compose",
        initial_peers=["/ip4/172.28.0.10/tcp/31338/p2p/12D3KooWabc"],
        coordinator_key='AAAA"key\\with/odd+chars=',
        comment="swarm compose\nkey ab:cd",
    )
    assert read_join_file(path) == {
        "swarm": "compose",
        "initial_peers": ["/ip4/172.28.0.10/tcp/31338/p2p/12D3KooWabc"],
        "coordinator_key": 'AAAA"key\\with/odd+chars=',
    }
    assert path.read_text().startswith("# swarm compose\n# key ab:cd\n")
    assert not list(path.parent.glob(".*.tmp"))
    out = run(["join", "--config", str(path)])  # usable as-is as `ravn-peer join --config`
    assert out["coordinator_key"] == 'AAAA"key\\with/odd+chars='
    assert out["swarm"] == "compose" and out["initial_peers"] == ["/ip4/172.28.0.10/tcp/31338/p2p/12D3KooWabc"]
    remove_join_file(path)
    remove_join_file(path)  # absent: fine
    assert not path.exists()
    with pytest.raises(ValueError):
        write_join_file(tmp_path / "j.toml", swarm="s\n", initial_peers=["/ip4/1.2.3.4/tcp/1"], coordinator_key="k")
    bad = write(tmp_path, 'swarm = "s"\ninitial_peers = "x"\ncoordinator_key = "k"\n', "bad.toml")
    with pytest.raises(ValueError, match="initial_peers a list"):
        read_join_file(bad)
