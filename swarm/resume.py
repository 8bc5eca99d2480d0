"""A peer's claim, when it re-attaches to a restarted coordinator, that it still holds its block.

Why gRPC metadata and not a protobuf field: the claim rides on ``Control.Join`` as one header
(``ravn-resume``), so the wire schema stays as it is and an old coordinator simply ignores it. It is
still a typed, bounded value: the coordinator parses it here and compares it with its own plan; a claim
that does not match (another run, another plan version, another block) gets a fresh assignment instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

RESUME_KEY = "ravn-resume"
ATTACHED_KEY = "ravn-attached"  # initial metadata of an accepted Join: "adopted" (trains on) or "assigned"
MAX_CLAIM_CHARS = 1024


@dataclass(frozen=True)
class ResumeClaim:
    """'I am resuming run R under plan version P, at stage S, layers [a, b), weight version V, generation G,
    plan epoch E.'"""

    run_id: str
    plan_version: int
    stage: int
    layer_start: int
    layer_end: int
    weight_version: int  # optimizer steps this block has taken
    generation: int  # how many assignments this peer process has had (for the logs)
    epoch: int  # the plan epoch of its assignment: a block of another timeline is never adopted

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RESUME_KEY, json.dumps(asdict(self), separators=(",", ":"))),)

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, str | bytes]] | None) -> ResumeClaim | None:
        """The claim in a call's metadata; None if there is none; ValueError if it is malformed."""
        value = next((v for k, v in metadata or () if k == RESUME_KEY), None)
        if value is None:
            return None
        if isinstance(value, bytes) or len(value) > MAX_CLAIM_CHARS:
            raise ValueError(f"{RESUME_KEY}: expected a short JSON text")
        try:
            raw = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{RESUME_KEY}: not JSON ({e})") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) != names:
            raise ValueError(f"{RESUME_KEY}: expected exactly the keys {sorted(names)}")
        if not isinstance(raw["run_id"], str) or len(raw["run_id"]) > 64:
            raise ValueError(f"{RESUME_KEY}: run_id must be a short string")
        for name in names - {"run_id"}:
            v = raw[name]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**53:
                raise ValueError(f"{RESUME_KEY}: {name} must be a non-negative integer")
        return cls(**raw)
