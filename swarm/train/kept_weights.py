"""Weights kept for the micro-batches in flight, so that a stale backward needs no second forward.

Under the async schedule a stage updates its weights while micro-batches forwarded on the old ones still
wait for their gradients. Their autograd graphs saved the weight tensors, which the optimizer's in-place
update would invalidate; recomputing each stale forward (PipeDream's weight stashing) cost a quarter of
the step time. Instead, a graph saves a trainable parameter by name (saved-tensor hooks), a copy of the
trainable parameters is kept once per weight generation that still has graphs in flight (PipeDream-2BW's
double buffer, generalised to the S + 1 versions a staleness bound S allows), and a stale backward runs
with the parameters pointed at that copy. The gradient still lands in the live parameters' ``.grad``.
Only trainable parameters are kept: a frozen base is the same in every generation. Activation
checkpointing's recompute reads the parameters too, so it also sees the generation its forward saw.

A forward may also run on *predicted* weights (``look_ahead``): the weights expected after the updates
that will land before its gradient comes back, so that the late gradient is nearly the one a sync
schedule would have computed (weight prediction, as in PipeMare and SpecTrain). Those weights are kept
the same way, under the key ``(generation, steps ahead, gradients of the step in progress already in)``, as
the prediction uses those gradients; the live weights are ``(generation, 0, 0)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _ParamRef:
    """What a graph saves in place of a trainable parameter (or a view of one, such as ``weight.t()``)."""

    name: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the parameter's own


Key = tuple[int, int, int]  # (generation, steps ahead, gradients in): the weights a graph was built on


class KeptWeights:
    """The weight versions that graphs in flight were built on; the live parameters are the newest."""

    def __init__(self, named_trainable: list[tuple[str, torch.nn.Parameter]]) -> None:
        self._params = dict(named_trainable)
        self.generation = 0  # counts in-place changes of the trainable parameters
        self._kept: dict[Key, dict[str, torch.Tensor]] = {}
        self._graphs: Counter[Key] = Counter()  # graphs in flight per weight version
        self._storage: dict[int, str] = {}
        self.peak_bytes = 0

    @property
    def live(self) -> Key:
        return (self.generation, 0, 0)

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kept in self._kept.values() for t in kept.values())

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Run a forward whose graph may outlive the next weight update."""
        self._storage = {p.untyped_storage().data_ptr(): name for name, p in self._params.items()}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _ParamRef:
        if not t.requires_grad or t.layout != torch.strided:
            return t
        try:
            name = self._storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            return t
        if name is None:
            return t
        own = self._params[name].storage_offset()
        return _ParamRef(name, t.size(), t.stride(), t.storage_offset() - own)

    def _unpack(self, saved: torch.Tensor | _ParamRef) -> torch.Tensor:
        if not isinstance(saved, _ParamRef):
            return saved
        p = self._params[saved.name]  # during a stale backward, pointed at the kept generation
        return p.detach().as_strided(saved.size, saved.stride, p.storage_offset() + saved.offset)

    def look_ahead(
        self, steps: int, predict: Callable[[int, int], dict[str, torch.Tensor] | None], known: int = 0
    ) -> Key:
        """The weights a forward should run on when its gradient will come back ``steps`` updates later.

        ``predict(steps, known)`` gives them (None: no prediction possible yet, e.g. before the first update),
        from the moments and the ``known`` gradients of the step in progress; they are made once per generation
        and per ``known``, and shared by every forward with the same ``steps`` and ``known``."""
        if steps <= 0:
            return self.live
        key = (self.generation, steps, known)
        if key in self._kept:
            return key
        predicted = predict(steps, known)
        if predicted is None:
            return self.live
        self._kept[key] = predicted
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return key

    def track(self, key: Key) -> Key:
        """A graph built on ``key``'s weights is now in flight."""
        self._graphs[key] += 1
        return key

    def release(self, key: Key) -> None:
        """A graph is done (back-propagated or dropped); forget its weights when it was the last."""
        self._graphs[key] -= 1
        if self._graphs[key] <= 0:
            del self._graphs[key]
            self._kept.pop(key, None)

    def before_update(self) -> None:
        """Call before the trainable parameters change in place: keep them if graphs still need them."""
        live = self.live
        for key in [k for k in self._kept if k[0] == self.generation and k not in self._graphs]:
            del self._kept[key]  # a prediction made for this generation that no graph used
        if self._graphs.get(live, 0) > 0:
            self._kept[live] = {
                n: p.detach().clone(memory_format=torch.preserve_format) for n, p in self._params.items()
            }
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.generation += 1

    @contextmanager
    def using(self, key: Key) -> Iterator[None]:
        """Point the parameters at ``key``'s values for one forward or backward, then back at the live ones."""
        if key == self.live:
            yield
            return
        kept = self._kept.get(key)
        if kept is None:
            raise RuntimeError(f"weights {key} were not kept (live: {self.live})")
        live: dict[str, torch.Tensor] = {}
        try:
            for name, p in self._params.items():
                live[name] = p.data
                p.data = kept[name]
            yield
        finally:
            for name, data in live.items():
                self._params[name].data = data

    def clear(self) -> None:
        """Every graph in flight is gone (a restore): nothing needs keeping."""
        self._kept.clear()
        self._graphs.clear()
        self.generation += 1
