"""One configuration story for every Ravn CLI: a TOML file and ``RAVN_*`` variables as option defaults.

Precedence, highest first (click's own order; this module only fills its two lower slots):

1. the command line (``--port 31400``);
2. the environment: ``RAVN_<OPTION>``, the option's name upper-cased with '-' as '_' (``RAVN_PORT``,
   ``RAVN_INITIAL_PEERS``: whitespace-separated for repeatable options), via click's ``auto_envvar_prefix``;
3. the config file (``--config PATH``, else ``RAVN_CONFIG``, else the program's default file if it exists),
   via click's ``default_map``; inside the file the most specific table wins: ``[peer.join]`` over
   ``[peer]`` over top-level (flat) keys;
4. the defaults written in the code.

Why a file section per command: one file can serve a whole machine (``[coordinator.serve]`` and
``[local]`` side by side); tables that belong to other programs are skipped. Flat keys keep the short
files people already have (``~/.config/ravn/peer.toml`` with ``swarm = ...``) working.

Why strict: a typo in a config file silently ignored costs an evening. An unknown key, a table nested
where no command lives, a value of the wrong type or unreadable TOML stops the program with one line
naming the file, the table and the key (and the closest known key), exit status 2.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.main import get_command_name
from typer.models import CommandInfo

SECTION_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
RESERVED = frozenset({"config", "help"})


class ConfigError(ValueError):
    """A config file that cannot be used; the message is the one line shown to the user."""


@dataclass(frozen=True)
class _Spec:
    prefix: str
    default_file: Path | None
    sections: Mapping[str, str]  # command path ("join", "group.cmd") -> TOML table ("peer.join")


def enable_config(
    app: typer.Typer,
    *,
    prefix: str = "RAVN",
    sections: Mapping[str, str] | None = None,
    default_file: Path | None = None,
) -> typer.Typer:
    """Give every command of ``app`` a ``--config PATH`` option and ``PREFIX_*`` environment defaults.

    ``sections`` maps a command name (as typed, e.g. ``"join"``; ``"group.cmd"`` for nested typers) to its
    TOML table (``"peer.join"``); a command not listed reads the table named like itself. Call it once,
    after every ``@app.command()``; it returns ``app``. A command must not declare its own ``config``
    parameter. Only typer's public API is used (a wrapped callback, ``context_settings``), so it works
    with typer releases that bundle their own click as well as with those that use click.
    """
    if not re.fullmatch(r"[A-Z][A-Z0-9_]*", prefix):
        raise ValueError(f"environment prefix {prefix!r}: use upper-case letters, digits and '_'")
    commands = list(_commands(app))
    names = [name for name, _ in commands]
    unknown = sorted(set(sections or {}) - set(names))
    if unknown:
        raise ValueError(
            f"sections name commands this app does not have: {', '.join(unknown)} (commands: {', '.join(names)})"
        )
    table = {name: (sections or {}).get(name, name) for name in names}
    for name, section in table.items():
        if not SECTION_RE.fullmatch(section):
            raise ValueError(f"config section {section!r} of command {name!r}: use names joined by '.'")
    spec = _Spec(prefix, default_file.expanduser() if default_file else None, table)
    for name, info in commands:
        if getattr(info.callback, "__ravn_config__", False):
            raise ValueError(f"enable_config was already applied to command {name!r}")
        info.callback = _with_config_option(info.callback, name, spec)
        info.context_settings = {**(info.context_settings or {}), "auto_envvar_prefix": prefix}
    return app


def _commands(app: typer.Typer, parent: str = "") -> Iterator[tuple[str, CommandInfo]]:
    for info in app.registered_commands:
        name = info.name or get_command_name(info.callback.__name__)
        yield f"{parent}{name}", info
    for group in app.registered_groups:
        name = group.name if isinstance(group.name, str) else group.typer_instance.info.name
        if not isinstance(name, str):
            raise ValueError("enable_config needs a name for every nested typer (app.add_typer(..., name=...))")
        yield from _commands(group.typer_instance, f"{parent}{name}.")


def _with_config_option(fn: Callable[..., Any], command: str, spec: _Spec) -> Callable[..., Any]:
    """``fn`` with one more, eager parameter ``--config`` whose callback fills ``ctx.default_map``."""
    sig = inspect.signature(fn, eval_str=True)
    if any(name in sig.parameters for name in RESERVED):
        raise TypeError(
            f"command {command!r} declares a 'config' parameter; enable_config adds --config itself, so remove it"
        )
    section = spec.sections[command]

    def load(ctx: typer.Context, value: Path | None) -> Path | None:
        _load_config(ctx, value, section, spec)
        return value

    default = f"; default {spec.default_file}" if spec.default_file else ""
    option = typer.Option(
        "--config",
        envvar=f"{spec.prefix}_CONFIG",
        is_eager=True,
        callback=load,
        metavar="PATH",
        show_default=False,
        help=f"TOML file of defaults for these options (table {section}, or top-level keys{default}). "
        f"Precedence: command line > {spec.prefix}_* environment > file > built-in defaults.",
    )
    extra = inspect.Parameter(
        "config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[Path | None, option]
    )
    params = list(sig.parameters.values())
    cut = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    params.insert(cut, extra)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("config", None)
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    wrapper.__ravn_config__ = True  # type: ignore[attr-defined]
    return wrapper


def _load_config(ctx: typer.Context, value: Path | None, section: str, spec: _Spec) -> None:
    if ctx.resilient_parsing:  # shell completion: never fail, never read files
        return
    path = value
    if path is None:
        if spec.default_file is None or not spec.default_file.is_file():
            return
        path = spec.default_file
    try:
        data = read_toml(path)
        sections = _app_sections(ctx, spec)
        sections.setdefault(section, frozenset(p.name for p in ctx.command.params if p.name not in RESERVED))
        defaults = section_defaults(data, section, sections, source=str(path))
        ctx.default_map = {**(ctx.default_map or {}), **_checked(ctx, defaults, str(path))}
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def read_toml(path: Path) -> dict[str, Any]:
    """Parse ``path`` or raise ConfigError with a one-line reason."""
    path = path.expanduser()
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None


def section_defaults(
    data: Mapping[str, Any], section: str, app_sections: Mapping[str, frozenset[str]], *, source: str = "config"
) -> dict[str, Any]:
    """The defaults the command reading ``section`` gets from a parsed file (keys normalised to param names).

    ``app_sections`` maps every section of this program to its commands' parameter names: a flat key or
    a key in a parent table must belong to some command under it, a key in a command's table to that
    command. Top-level tables that are no prefix of this program's sections belong to other programs.
    """
    _check_table(data, (), app_sections, source)
    known = app_sections.get(section, frozenset())
    out: dict[str, Any] = {}
    table: Mapping[str, Any] | None = data
    for part in (None, *section.split(".")):  # top level, then each table down to the command's own
        if part is not None:
            nxt = table.get(part)
            table = nxt if isinstance(nxt, Mapping) else None
        if table is None:
            break
        out.update({_norm(k): v for k, v in table.items() if not isinstance(v, Mapping) and _norm(k) in known})
    return out


def _check_table(
    table: Mapping[str, Any], path: tuple[str, ...], app_sections: Mapping[str, frozenset[str]], source: str
) -> None:
    under = {s: names for s, names in app_sections.items() if tuple(s.split("."))[: len(path)] == path}
    known = frozenset().union(*under.values()) if under else frozenset()
    where = f"config file {source}" + (f", [{'.'.join(path)}]" if path else "")
    for key, value in table.items():
        sub = (*path, key)
        if isinstance(value, Mapping):
            if any(tuple(s.split("."))[: len(sub)] == sub for s in under):
                _check_table(value, sub, app_sections, source)
            elif path:
                sections = ", ".join(f"[{s}]" for s in sorted(under))
                raise ConfigError(f"{where}: unknown table [{'.'.join(sub)}] (this program reads {sections})")
            continue  # a top-level table of another program
        if _norm(key) not in known:
            raise ConfigError(f"{where}: unknown key {key!r}{_suggest(_norm(key), known)}")


def _checked(ctx: typer.Context, defaults: dict[str, Any], source: str) -> dict[str, Any]:
    """Normalise and type-check every value now, so a bad one is reported against the file, not a flag."""
    params = {p.name: p for p in ctx.command.params}
    out = {}
    for name, value in defaults.items():
        param = params[name]
        multiple = bool(getattr(param, "multiple", False)) or param.nargs != 1
        if multiple and isinstance(value, str):
            value = [value]
        elif not multiple and isinstance(value, list):
            raise ConfigError(f"config file {source}: {name} takes one value, not a list")
        try:
            _convert(param, ctx, value)
        except typer.BadParameter as e:
            raise ConfigError(f"config file {source}: {name} = {value!r}: {e.message}") from None
        out[name] = value
    return out


def _convert(param: Any, ctx: typer.Context, value: Any) -> Any:
    """Convert a value as the command line would, without running the option's callback."""
    runtime = getattr(param, "get_runtime_param", None)  # typer with its own click (0.2x and later)
    if runtime is not None:
        return runtime().coerce(value, param=param, ctx=ctx)
    return param.type_cast_value(ctx, value)  # typer on click


def _app_sections(ctx: typer.Context, spec: _Spec) -> dict[str, frozenset[str]]:
    """Every command of this program: its TOML table and its parameter names (walked from the root)."""
    found: dict[str, Any] = {}

    def walk(cmd: Any, path: str) -> None:
        subs = getattr(cmd, "commands", None)
        if isinstance(subs, Mapping):
            for name, sub in subs.items():
                walk(sub, f"{path}.{name}" if path else name)
        else:
            found[path] = cmd

    root = ctx.find_root().command
    walk(root, "")
    if "" in found and len(spec.sections) == 1:  # a one-command program: typer runs the command as the root
        found = {next(iter(spec.sections)): found.pop("")}
    return {
        section: frozenset(p.name for p in found[name].params if p.name and p.name not in RESERVED)
        for name, section in spec.sections.items()
        if name in found
    }


def _norm(key: str) -> str:
    return key.replace("-", "_")


def _suggest(key: str, known: frozenset[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---- the coordinator's join file -----------------------------------------------------------------
JOIN_KEYS = ("swarm", "initial_peers", "coordinator_key")


def write_join_file(
    path: Path, *, swarm: str, initial_peers: list[str], coordinator_key: str, comment: str = "", swarm_token: str = ""
) -> Path:
    """Write what ``ravn-peer join`` needs as flat TOML, atomically (readers never see half a file).

    Why a file: in Docker and other automated setups the coordinator's DHT multiaddr carries a peer id
    that exists only once it runs. The file is a valid ``ravn-peer join --config`` file and the Docker
    peer entrypoint reads it. With ``swarm_token`` it holds the swarm's secret and is written 0600.
    """
    if not initial_peers:
        raise ValueError("a join file needs at least one initial peer multiaddr")
    lines = [
        f"# {line}"
        for line in (comment or "Written by ravn-coordinator serve; read by ravn-peer join --config.").splitlines()
    ]
    lines += [
        f"swarm = {_toml_str(swarm)}",
        "initial_peers = [" + ", ".join(_toml_str(p) for p in initial_peers) + "]",
        f"coordinator_key = {_toml_str(coordinator_key)}",
    ]
    if swarm_token:
        lines.append(f"swarm_token = {_toml_str(swarm_token)}")
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.chmod(0o600 if swarm_token else 0o644)
    tmp.replace(path)
    return path


def read_join_file(path: Path) -> dict[str, Any]:
    """The three join values from a join file; ConfigError if any is missing or of the wrong type."""
    data = read_toml(path)
    missing = [k for k in JOIN_KEYS if k not in data]
    if missing:
        raise ConfigError(f"join file {path} lacks {', '.join(missing)}")
    peers = data["initial_peers"]
    if not (
        isinstance(data["swarm"], str)
        and isinstance(data["coordinator_key"], str)
        and isinstance(peers, list)
        and peers
        and all(isinstance(p, str) for p in peers)
    ):
        raise ConfigError(
            f"join file {path}: swarm and coordinator_key must be strings, initial_peers a list of strings"
        )
    return {k: data[k] for k in JOIN_KEYS}


def remove_join_file(path: Path) -> None:
    """Remove a join file if present: a stale one names a DHT identity that no longer exists."""
    path.expanduser().unlink(missing_ok=True)


def _toml_str(value: str) -> str:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError(f"control characters are not allowed in a join file value: {value!r:.60}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
