"""Error feedback for lossy gradient codecs: what the quantiser dropped is sent with the next message.

Quantising a gradient to 4 or 8 bits drops small components, and it drops the *same* ones step after
step (a coordinate far below its block's absmax rounds to zero every time), so the bias accumulates
and the optimiser never sees it. Error feedback keeps, per link, the residual ``r = (x + r) - decode(q)``
and adds it to the next tensor before quantising: the running sum of what the receiver decodes then
differs from the running sum of true gradients by the last residual only (the sum telescopes), which
is bounded by one quantisation step per element instead of growing with the number of steps.

One instance per link and direction (the residual belongs to one stream of same-shaped tensors).
"""

from __future__ import annotations

import torch

from swarm.wire.codecs import EncodedTensor, decode, encode


class ErrorFeedback:
    """Per-link residual memory around :func:`swarm.wire.codecs.encode`.

    The residual is float32 whatever the input dtype (it is the small part fp16/bf16 would lose), lives
    on the input's device, and is keyed by shape, dtype and device: a tensor that differs in any of them
    starts from a zero residual instead of failing. Not thread-safe: one link, one sender.
    """

    def __init__(self) -> None:
        self._residual: torch.Tensor | None = None
        self._key: tuple[tuple[int, ...], torch.dtype, torch.device] | None = None

    @property
    def residual(self) -> torch.Tensor | None:
        """The error still owed to the receiver (``None`` before the first call or after a reset)."""
        return self._residual

    def reset(self) -> None:
        """Forget the residual, e.g. when the link is re-established or the run restarts."""
        self._residual = None
        self._key = None

    def encode(self, x: torch.Tensor, codec: str, **options: object) -> EncodedTensor:
        """Encode ``x + residual`` with ``codec`` and keep what the encoding lost for the next call.

        ``options`` go to :func:`swarm.wire.codecs.encode` unchanged. If encoding raises (NaN in ``x``, say)
        the residual is left as it was.
        """
        key = (tuple(x.shape), x.dtype, x.device)
        target = x.detach().to(torch.float32, copy=True)  # never alias (and later modify) the caller's x
        if self._residual is not None and key == self._key:
            target.add_(self._residual)
        enc = encode(target.to(x.dtype), codec, **options)
        residual = target.sub_(decode(enc, max_elements=max(target.numel(), 1), device=x.device).float())
        self._residual, self._key = residual, key
        return enc
