"""The committed generated protobuf code is exactly what proto/*.proto produces."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_the_proto_sources(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.name: p.read_text() for p in gen.generate(tmp_path / "pb")}
    committed = {p.name: p.read_text() for p in (ROOT / "swarm" / "pb").iterdir() if p.is_file()}
    assert fresh.keys() == committed.keys(), "files differ: run python scripts/gen_proto.py"
    for name, text in fresh.items():
        assert committed[name] == text, f"swarm/pb/{name} is stale: run python scripts/gen_proto.py"
