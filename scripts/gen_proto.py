"""Regenerate swarm/pb from proto/ with grpcio-tools.

Generated code is committed so users need no protoc; tests/test_proto_drift.py runs this into a
temporary folder and fails when the committed copy differs from what the sources produce.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "swarm" / "pb"


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto into ``out_dir`` and make its imports package-relative."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        if protoc.main(args + [str(p) for p in protos]) != 0:
            raise RuntimeError("protoc failed")
        written = []
        for src in sorted(Path(tmp).iterdir()):
            text = re.sub(r"^import (\w+_pb2)", r"from . import \1", src.read_text(), flags=re.M)
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated protobuf and gRPC code; edit proto/*.proto and run scripts/gen_proto.py."""\n')
    return written + [init]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR
    for path in generate(target):
        print(path.relative_to(target.parent) if path.is_relative_to(target.parent) else path)
