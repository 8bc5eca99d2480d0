"""Byte sizes as people write them (swarm/sizes.py) and the memory a peer offers (``ravn-peer join --memory``)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from peer.cli import app as peer_app
from peer.settings import PeerSettings
from swarm.security.auth import generate_token
from swarm.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("20GiB", 20 * 2**30),
        ("512MiB", 512 * 2**20),
        ("8GB", 8 * 10**9),
        ("1.5G", 3 * 2**29),
        ("1KiB", 1024),
        ("4096", 4096),
        (" 2 mib ", 2 * 2**20),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "20 GiBs", "-1GiB", "1e9", "2PiB"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="size|too large"):
        parse_size(text)


def test_format_size() -> None:
    assert [format_size(n) for n in (12, 1024, 640 * 1024, 1.5 * 2**30)] == ["12 B", "1 KiB", "640 KiB", "1.5 GiB"]


def test_memory_offered_is_the_smaller() -> None:
    assert PeerSettings(peer_id="p").offered_memory(8 * 2**30) == 8 * 2**30
    assert PeerSettings(peer_id="p", memory_limit=2**30).offered_memory(8 * 2**30) == 2**30
    assert PeerSettings(peer_id="p", memory_limit=16 * 2**30).offered_memory(8 * 2**30) == 8 * 2**30


def test_join_refuses_a_bad_memory_in_one_line() -> None:
    result = CliRunner().invoke(
        peer_app,
        [
            "join",
            "--swarm",
            "s",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/1",
            "--coordinator-key",
            "k",
            "--swarm-token",
            generate_token(),
            "--memory",
            "lots",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "--memory" in result.output and "not a size" in result.output, result.output
