"""The tables of docs/SCALING.md, from ``ravn plan --json`` itself (run in-process, same code as the CLI).

    python -m scripts.scaling_grid [docs/configs/llama-3-70b.json] [24GiB]   # from the repository root

For each base storage (bf16, int8, NF4), with and without activation checkpointing: the fewest
``MEMORY`` peers that fit, their layers, and the predicted tokens/s at 20/100/1000 Mbit/s for five
codec pairs. Nothing is trained or downloaded.
"""

from __future__ import annotations

import json
import sys

from typer.testing import CliRunner

from coordinator.ravn_cli import app

QUANTS = ("none", "int8", "nf4")
LINKS = (20, 100, 1000)
CODECS = (("fp32", "fp32"), ("bf16", "bf16"), ("int8", "int8"), ("int4_rot", "int8"), ("int4_rot", "int4_rot"))
MAX_PEERS = 80


def run_plan(model: str, memory: str, peers: int, link: int, *extra: str) -> dict | None:
    args = ["plan", "--model", model, "--json", *extra]
    args += [arg for _ in range(peers) for arg in ("--peer", f"{memory},{link}mbit")]
    result = CliRunner().invoke(app, args)
    return json.loads(result.stdout) if result.exit_code == 0 else None


def fewest_peers(model: str, memory: str, *extra: str) -> int:
    for n in range(1, MAX_PEERS + 1):
        if run_plan(model, memory, n, 100, *extra) is not None:
            return n
    raise SystemExit(f"no plan fits with up to {MAX_PEERS} peers of {memory}")


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "docs/configs/llama-3-70b.json"
    memory = sys.argv[2] if len(sys.argv) > 2 else "24GiB"
    links = " | ".join(f"{link} Mbit/s" for link in LINKS)
    print(f"| base | checkpointing | peers of {memory} | layers per peer | codecs (fwd/bwd) | {links} |")
    print("|---|---|---:|---|---|" + "---:|" * len(LINKS))
    for ckpt in (False, True):
        for quant in QUANTS:
            extra = ["--quant", quant] + (["--activation-checkpointing"] if ckpt else [])
            n = fewest_peers(model, memory, *extra)
            for fwd, bwd in CODECS:
                cells, sizes = [], []
                for link in LINKS:
                    report = run_plan(model, memory, n, link, *extra, "--wire-forward", fwd, "--wire-backward", bwd)
                    cells.append(f"{report['tokens_per_second']:,.0f}")
                    sizes = [b - a for a, b in (r["layers"] for r in report["stages"])]
                layers = f"{min(sizes)}-{max(sizes)}" if min(sizes) != max(sizes) else str(sizes[0])
                name = "bf16" if quant == "none" else quant
                row = [name, "yes" if ckpt else "no", str(n), layers, f"{fwd}/{bwd}", *cells]
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
