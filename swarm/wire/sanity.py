"""Is this activation or gradient plausible? Per-link norm statistics, rejections and quarantine.

A tensor can be well-formed (right shape, dtype, finite) and still poison training: one micro-batch of
activations scaled by 1e20 turns the receiving stage's loss, gradients and then *weights* into NaN, and
a gradient ten thousand times its usual size wrecks the AdamW moments for many steps. Shape checks
cannot see that; statistics can.

* :class:`NormTracker` keeps a running distribution of ``log ||x||`` for one link and direction: plain
  mean/variance during a warm-up, then an exponential moving average. After warm-up a tensor whose
  log-norm is more than ``z_max`` deviations from the mean is refused. Refused tensors do not update
  the statistics, so an attacker cannot drag them along with outliers (only slowly, inside the bound).
* :class:`LinkSanity` checks one tensor: finite, every element within ``max_abs`` (a hard bound that
  holds during warm-up too), then the norm; it counts rejections per sender and feeds a Quarantine.
* :class:`Quarantine` says a sender should be excluded after ``max_rejections`` within ``window_s``,
  with a reason for ``ravn status``.

The check costs two reductions over the tensor (aminmax, norm) and no copy.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarm.wire.packets import WireError

TINY = 1e-30  # the norm of an all-zero tensor is taken as this, so its log is finite (and far out)


class SanityError(WireError):
    """A tensor refused as implausible; a WireError, so the transport ends the stream with the reason."""


@dataclass(frozen=True)
class SanitySettings:
    warmup: int = 16  # samples accepted (if finite and within max_abs) before z-scores apply
    z_max: float = 6.0  # refuse |log-norm - mean| > z_max * std
    alpha: float = 0.05  # EMA weight of a new sample after warm-up (~20-sample memory)
    min_std: float = 0.25  # floor on the log-norm std: a very steady link still allows x e^(z_max*0.25)
    max_abs: float = 1e6  # no element beyond this, ever (fp32 overflows in x^2 sums near 1e19)
    reject_low: bool = True  # refuse norms far below the usual too (all-zero or vanishing tensors)


# What the peer daemon uses, tuned against excluding an honest peer (three rejections quarantine a sender).
# A std floor of 1 in log-norm lets a tensor be up to e^6 ~ 400x its link's typical norm: honest gradients
# jump 5-10x after a re-plan or a loss spike (seen in tests/test_poisoning.py with the default 0.25),
# while poisoning worth the name (x1e3 and beyond, NaN, 1e6 elements) is still refused. Vanishing tensors
# harm nothing (a zero gradient moves no weight) and an honest stage can send one (all targets masked).
DAEMON_SETTINGS = SanitySettings(min_std=1.0, reject_low=False)


class NormTracker:
    """Running mean and deviation of ``log ||x||`` for one stream of tensors."""

    def __init__(self, settings: SanitySettings | None = None) -> None:
        self.s = settings or SanitySettings()
        self.count = 0
        self.mean = 0.0
        self.var = 0.0
        self._m2 = 0.0

    @property
    def std(self) -> float:
        return max(math.sqrt(max(self.var, 0.0)), self.s.min_std)

    @property
    def warm(self) -> bool:
        return self.count >= self.s.warmup

    def zscore(self, norm: float) -> float:
        return (math.log(max(norm, TINY)) - self.mean) / self.std

    def judge(self, norm: float) -> str | None:
        """Why ``norm`` is implausible for this stream, or None; does not update."""
        if not self.warm:
            return None
        z = self.zscore(norm)
        if z > self.s.z_max or (self.s.reject_low and z < -self.s.z_max):
            typical = math.exp(self.mean)
            side = "above" if z > 0 else "below"
            return (
                f"norm {norm:.3g} is {abs(z):.1f} deviations {side} this link's running log-norm "
                f"(typical {typical:.3g}, limit {self.s.z_max:g})"
            )
        return None

    def update(self, norm: float) -> None:
        """Fold an accepted norm in: Welford during warm-up, EMA afterwards."""
        v = math.log(max(norm, TINY))
        self.count += 1
        if self.count <= self.s.warmup:
            delta = v - self.mean
            self.mean += delta / self.count
            self._m2 += delta * (v - self.mean)
            self.var = self._m2 / self.count
            return
        a = self.s.alpha
        delta = v - self.mean
        self.mean += a * delta
        self.var = (1 - a) * (self.var + a * delta * delta)


@dataclass
class Quarantine:
    """Exclude a sender after ``max_rejections`` rejections within ``window_s`` seconds."""

    max_rejections: int = 3
    window_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _recent: dict[str, deque[float]] = field(default_factory=dict)
    _reasons: dict[str, str] = field(default_factory=dict)

    def record(self, sender: str, reason: str) -> bool:
        """Note one rejection of ``sender``; True when this puts (or keeps) it in quarantine."""
        now = self.clock()
        times = self._recent.setdefault(sender, deque(maxlen=self.max_rejections))
        times.append(now)
        while times and now - times[0] > self.window_s:
            times.popleft()
        if sender not in self._reasons and len(times) >= self.max_rejections:
            self._reasons[sender] = (
                f"quarantined after {len(times)} rejected tensors within {self.window_s:g} s; last: {reason}"
            )
        return sender in self._reasons

    def excluded(self, sender: str) -> bool:
        return sender in self._reasons

    def reason(self, sender: str) -> str | None:
        """A line for ``ravn status``, or None when the sender is not quarantined."""
        return self._reasons.get(sender)

    def status(self) -> dict[str, str]:
        return dict(self._reasons)

    def release(self, sender: str) -> None:
        """Forgive ``sender`` (an operator decision, or a new run)."""
        self._reasons.pop(sender, None)
        self._recent.pop(sender, None)


def tensor_stats(x: torch.Tensor) -> tuple[bool, float, float]:
    """(all finite, max |x|, L2 norm) in two reductions; the norm is taken in float32 at least."""
    if x.numel() == 0:
        return True, 0.0, 0.0
    lo, hi = torch.aminmax(x.detach())
    finite = bool(torch.isfinite(lo) & torch.isfinite(hi))
    max_abs = max(abs(float(lo)), abs(float(hi)))
    data = x.detach() if x.dtype in (torch.float32, torch.float64) else x.detach().float()
    return finite, max_abs, float(torch.linalg.vector_norm(data))


class LinkSanity:
    """Plausibility checks for the tensors arriving on one peer's links, keyed by (link, kind)."""

    def __init__(self, settings: SanitySettings | None = None, quarantine: Quarantine | None = None) -> None:
        self.s = settings or SanitySettings()
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        self.trackers: dict[tuple[str, str], NormTracker] = {}
        self.rejections: Counter[str] = Counter()
        self.accepted = 0

    def tracker(self, link: str, kind: str) -> NormTracker:
        key = (link, kind)
        if key not in self.trackers:
            self.trackers[key] = NormTracker(self.s)
        return self.trackers[key]

    def check(self, x: torch.Tensor, *, sender: str, link: str, kind: str) -> float:
        """Accept ``x`` (returns its norm, now part of the link's statistics) or raise SanityError.

        ``kind`` is "activations" or "gradients" (their scales differ by orders of magnitude);
        ``link`` names the neighbour connection, ``sender`` the peer charged for a rejection.
        """
        if self.quarantine.excluded(sender):
            raise SanityError(f"sender {sender!r} is quarantined: {self.quarantine.reason(sender)}")
        if not x.is_floating_point():
            return self._reject(sender, f"{kind} must be floating point, got {x.dtype}")
        finite, max_abs, norm = tensor_stats(x)
        if not finite:
            return self._reject(sender, f"{kind} contain NaN or Inf")
        if max_abs > self.s.max_abs:
            return self._reject(
                sender, f"{kind} have an element of magnitude {max_abs:.3g} (limit {self.s.max_abs:.3g})"
            )
        if not math.isfinite(norm):
            return self._reject(sender, f"{kind} norm overflows float32")
        tracker = self.tracker(link, kind)
        reason = tracker.judge(norm)
        if reason is not None:
            return self._reject(sender, f"{kind}: {reason}")
        tracker.update(norm)
        self.accepted += 1
        return norm

    def forgive(self, sender: str) -> None:
        """Release ``sender`` from quarantine and forget its links' statistics (an operator decision)."""
        self.quarantine.release(sender)
        for key in [k for k in self.trackers if k[0] == sender]:
            del self.trackers[key]

    def charge(self, sender: str, reason: str) -> bool:
        """Count a refusal that another check made (an averaging contribution, say) against ``sender``, as a
        rejected tensor counts: enough of them quarantine it. True when ``sender`` is (now) quarantined."""
        self.rejections[sender] += 1
        return self.quarantine.record(sender, reason)

    def _reject(self, sender: str, reason: str) -> float:
        quarantined = self.charge(sender, reason)
        suffix = f" (sender {sender!r} is now quarantined)" if quarantined else ""
        raise SanityError(reason + suffix)

    def status(self) -> dict[str, str]:
        """Per-sender lines for ``ravn status``: rejections, and the quarantine reason if any."""
        out = {}
        for sender, n in self.rejections.items():
            reason = self.quarantine.reason(sender)
            out[sender] = f"{n} rejected" + (f"; {reason}" if reason else "")
        return out
