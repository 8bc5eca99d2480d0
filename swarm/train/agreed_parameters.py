"""The parameters a replica group last agreed on, and DiLoCo's outer step that moves every replica on from them.

Replicas of one block train apart between averages; what they exchange is each one's change since the
agreed parameters, and what they apply is the same averaged change to the same agreed bytes, so the agreed
parameters stay bit-identical across the group (the digest shows it) while each keeps its local progress.
"""

from __future__ import annotations

import hashlib

import torch


class AgreedParameters:
    """A replica's copy of the group's agreed parameters and its outer (Nesterov) momentum."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Start from the parameters every replica starts from (same seed or same checkpoint)."""
        self._named = named
        self.anchor = {n: p.detach().clone() for n, p in named}
        self._momentum: dict[str, torch.Tensor] = {}

    def delta(self) -> dict[str, torch.Tensor]:
        """This replica's change since the agreed parameters: what it contributes to an average."""
        return {n: (p.detach() - self.anchor[n]).cpu() for n, p in self._named}

    def apply(
        self, average: dict[str, torch.Tensor], own: dict[str, torch.Tensor], outer_lr: float, momentum: float
    ) -> None:
        """Move to the group's new agreed parameters, keeping the local progress made since ``own`` was taken.

        The outer step is the averaged change scaled by ``outer_lr``, with optional Nesterov momentum. The
        parameters change in place: whoever keeps weights for graphs in flight keeps them first."""
        missing = set(self.anchor) - set(average)
        if missing:
            raise ValueError(f"the average lacks {sorted(missing)[:3]}")
        with torch.no_grad():
            for name, p in self._named:
                change = average[name].to(device=p.device, dtype=p.dtype)
                if tuple(change.shape) != tuple(p.shape) or not bool(torch.isfinite(change).all()):
                    raise ValueError(f"the average of {name} has shape {list(change.shape)} or non-finite values")
                if momentum:
                    m = self._momentum.get(name)
                    m = change.clone() if m is None else m.mul_(momentum).add_(change)
                    self._momentum[name] = m
                    change = change + momentum * m
                step = change * outer_lr
                p.add_(step - own[name].to(device=p.device, dtype=p.dtype))
                self.anchor[name].add_(step)

    def digest(self) -> str:
        """A fingerprint of the agreed parameters: equal on every replica after each average."""
        h = hashlib.sha256()
        for name in sorted(self.anchor):
            h.update(name.encode())
            h.update(self.anchor[name].detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]
