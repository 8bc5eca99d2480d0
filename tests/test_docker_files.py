"""docker/: what can be checked without a Docker engine (there is none on the development machines).

The compose file parses and points at Dockerfiles that exist; every path a Dockerfile copies exists and
survives its .dockerignore; the entrypoint passes ``bash -n`` and, run against a stub ``ravn-peer``,
turns a real join file into the variables and flags ravn-peer reads; every program and option the files
name exists in pyproject.toml and in the typer CLIs.
"""

from __future__ import annotations

import ast
import ipaddress
import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer.main
import yaml

from swarm.config_file import write_join_file

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
ENTRYPOINT = DOCKER / "peer-entrypoint.sh"
ENTRYPOINT_NAME = "ravn-docker-peer"  # where the Dockerfiles install it


def console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def cli_options(program: str, command: str) -> set[str]:
    """Every --flag of ``program command``, read from the typer app the console script runs."""
    module = console_scripts()[program].split(":")[0]
    app = __import__(module, fromlist=["app"]).app
    cmd = typer.main.get_command(app).commands[command]
    return {
        opt
        for p in cmd.params
        for opt in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))
        if opt.startswith("--")
    } | {"--help"}


def flags(args: list[str]) -> set[str]:
    return {a.split("=")[0] for a in args if a.startswith("--")}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


# ---- Dockerfiles ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_existing_paths_that_survive_dockerignore(name: str) -> None:
    steps = instructions(DOCKER / name)
    ignore = (DOCKER / f"{name}.dockerignore").read_text().split()
    kept = {line[1:].removesuffix("/**") for line in ignore if line.startswith("!")}
    copies = [shlex.split(args) for word, args in steps if word == "COPY"]
    assert copies
    for args in copies:
        assert not any(a.startswith("--from") for a in args)
        *sources, _dest = [a for a in args if not a.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), f"{name}: COPY {src}: no such path in the repository"
            assert src in kept, f"{name}: COPY {src} is excluded by {name}.dockerignore"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_user_ports_torch_and_programs(name: str) -> None:
    steps = instructions(DOCKER / name)
    words = [w for w, _ in steps]
    args = {a.split("=")[0]: a.split("=", 1)[1] for w, a in steps if w == "ARG" and "=" in a}
    assert "FROM" in words and all(w == "ARG" for w in words[: words.index("FROM")])
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{name} must run as a non-root user"
    exposed = {int(p.split("/")[0]) for w, a in steps if w == "EXPOSE" for p in a.split()}
    assert exposed == {31337, 31338, 31400}
    assert args["TORCH_VERSION"] == "2.13.0"
    torch_install = next(a for w, a in steps if w == "RUN" and "torch==" in a)
    assert "${TORCH_INDEX_URL}" in torch_install
    cmd = json.loads(next(a for w, a in steps if w == "CMD"))
    assert cmd[0] in console_scripts()
    installed = [shlex.split(a)[-1] for w, a in steps if w == "COPY" and "peer-entrypoint.sh" in a]
    assert installed == [f"/usr/local/bin/{ENTRYPOINT_NAME}"]
    if name == "Dockerfile.cpu":
        assert next(a for w, a in steps if w == "FROM") == "python:3.11-slim"
        assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    else:
        assert next(a for w, a in steps if w == "FROM") == "${CUDA_IMAGE}"
        assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_IMAGE"]
        assert any("python3.11" in a for w, a in steps if w == "RUN")


def test_console_scripts_exist() -> None:
    scripts = console_scripts()
    assert {"ravn", "ravn-peer", "ravn-coordinator"} <= set(scripts)
    for program in ("ravn", "ravn-peer", "ravn-coordinator"):
        module, func = scripts[program].split(":")
        source = ROOT / (module.replace(".", "/") + ".py")
        tree = ast.parse(source.read_text())  # no import: `ravn` pulls in torch
        assert any(isinstance(node, ast.FunctionDef) and node.name == func for node in tree.body), program


# ---- compose -------------------------------------------------------------------------------------
def test_compose_builds_existing_dockerfiles(compose: dict) -> None:
    services = compose["services"]
    assert {"coordinator", "peer1", "peer2", "peer3"} <= set(services)
    for name, svc in services.items():
        context = (DOCKER / svc["build"]["context"]).resolve()
        assert context == ROOT, f"{name}: build context must be the repository root"
        assert (context / svc["build"]["dockerfile"]).is_file()
        assert svc["image"] == "ravn:cpu" and svc["init"] is True


def test_compose_coordinator_command_and_fixed_address(compose: dict) -> None:
    svc = compose["services"]["coordinator"]
    program, command, *args = svc["command"]
    assert program in console_scripts() and (program, command) == ("ravn-coordinator", "serve")
    missing = flags(args) - cli_options(program, command)
    assert not missing, f"compose passes options ravn-coordinator serve does not have: {missing}"
    value = {a: b for a, b in zip(args, args[1:], strict=False) if a.startswith("--")}
    address = svc["networks"]["ravn"]["ipv4_address"]
    subnet = ipaddress.ip_network(compose["networks"]["ravn"]["ipam"]["config"][0]["subnet"])
    assert value["--announce"] == address and ipaddress.ip_address(address) in subnet
    assert value["--host"] == "0.0.0.0" and int(value["--peers"]) == 3
    assert svc["healthcheck"]["test"][-1] == value["--join-file"]
    assert f"shared:{Path(value['--join-file']).parent}" in svc["volumes"]


def test_compose_peers_use_the_entrypoint_and_the_join_file(compose: dict) -> None:
    coordinator_args = compose["services"]["coordinator"]["command"]
    join_file = coordinator_args[coordinator_args.index("--join-file") + 1]
    options = cli_options("ravn-peer", "join")
    names = set()
    for name in ("peer1", "peer2", "peer3"):
        svc = compose["services"][name]
        assert svc["entrypoint"] == [ENTRYPOINT_NAME]
        assert svc["environment"]["RAVN_JOIN_FILE"] == join_file
        assert f"shared:{Path(join_file).parent}:ro" in svc["volumes"]
        assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert not flags(svc["command"]) - options, f"{name} passes options ravn-peer join does not have"
        names.add(svc["command"][svc["command"].index("--name") + 1])
    assert len(names) == 3


# ---- the peer entrypoint -------------------------------------------------------------------------
def test_entrypoint_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    assert os.access(ENTRYPOINT, os.X_OK)


def test_entrypoint_flags_and_variables_are_ones_ravn_peer_reads() -> None:
    text = ENTRYPOINT.read_text()
    exec_line = text[text.index("exec ravn-peer join") :].replace("\\\n", " ")
    assert not flags(exec_line.split()) - cli_options("ravn-peer", "join")
    module = console_scripts()["ravn-peer"].split(":")[0]
    join = typer.main.get_command(__import__(module, fromlist=["app"]).app).commands["join"]
    auto = (join.context_settings or {}).get("auto_envvar_prefix")
    readable = {p.envvar for p in join.params if isinstance(p.envvar, str)}
    readable |= {f"{auto}_{p.name.upper()}" for p in join.params} if auto else set()
    for variable in ("RAVN_SWARM", "RAVN_INITIAL_PEERS", "RAVN_COORDINATOR_KEY"):
        assert variable in text and variable in readable


@pytest.fixture
def stub_path(tmp_path: Path) -> str:
    """A PATH whose ravn-peer prints its environment and arguments instead of joining."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    stub = bin_dir / "ravn-peer"
    stub.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "print(json.dumps({'args': sys.argv[1:], "
        "'env': {k: v for k, v in os.environ.items() if k.startswith('RAVN_')}}))\n"
    )
    stub.chmod(0o755)
    return f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"


def run_entrypoint(path: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAVN_")}
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *args], env={**clean, "PATH": path, **env}, capture_output=True, text=True, timeout=30
    )


def test_entrypoint_turns_the_join_file_into_ravn_peer_variables(tmp_path: Path, stub_path: str) -> None:
    maddrs = ["/ip4/172.28.0.10/tcp/31338/p2p/12D3KooWA", "/ip4/127.0.0.1/tcp/31338/p2p/12D3KooWA"]
    join = write_join_file(
        tmp_path / "join.toml",
        swarm="compose",
        initial_peers=maddrs,
        coordinator_key="AAAAC3Nza'C1lZDI1NTE5 $(touch pwned)",
    )
    proc = run_entrypoint(stub_path, {"RAVN_JOIN_FILE": str(join), "RAVN_ANNOUNCE": "172.28.0.11"}, "--name", "peer1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["env"]["RAVN_SWARM"] == "compose"
    assert out["env"]["RAVN_INITIAL_PEERS"].split() == maddrs
    assert out["env"]["RAVN_COORDINATOR_KEY"] == "AAAAC3Nza'C1lZDI1NTE5 $(touch pwned)"  # quoted, not run
    assert not (Path.cwd() / "pwned").exists()
    assert out["args"][:1] == ["join"] and out["args"][-2:] == ["--name", "peer1"]
    a = out["args"]
    assert (a[a.index("--host") + 1], a[a.index("--announce") + 1], a[a.index("--port") + 1]) == (
        "0.0.0.0",
        "172.28.0.11",
        "31400",
    )


def test_entrypoint_keeps_variables_already_set_and_finds_its_address(tmp_path: Path, stub_path: str) -> None:
    join = write_join_file(
        tmp_path / "join.toml", swarm="compose", initial_peers=["/ip4/1.2.3.4/tcp/1/p2p/X"], coordinator_key="K"
    )
    proc = run_entrypoint(stub_path, {"RAVN_JOIN_FILE": str(join), "RAVN_SWARM": "mine", "RAVN_PORT": "31500"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["env"]["RAVN_SWARM"] == "mine" and out["env"]["RAVN_COORDINATOR_KEY"] == "K"
    a = out["args"]
    assert a[a.index("--port") + 1] == "31500"
    ipaddress.ip_address(a[a.index("--announce") + 1])  # this machine's address, resolved from its hostname


def test_entrypoint_gives_up_with_one_line_when_no_join_file(tmp_path: Path, stub_path: str) -> None:
    proc = run_entrypoint(stub_path, {"RAVN_JOIN_FILE": str(tmp_path / "none.toml"), "RAVN_JOIN_WAIT": "0"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().startswith("error: no join file at") and len(proc.stderr.strip().splitlines()) == 1
