"""Home-internet link profiles and the `tc` commands that enforce their bandwidth caps.

A volunteer's access link is asymmetric (cable and DSL upload is a fraction of download) and has its
own latency, and pipeline training is bound by exactly these two numbers, so the lab models each
host's link as one `LinkProfile`. Bandwidth is enforced in the kernel with a token-bucket filter
(`tbf`; this kernel has no `netem`, and shaping ingress would need `ifb`), so both caps are egress
shaping: upload on the host's end of its veth, download on the bridge's end. Latency cannot be added
in the kernel without `netem`; it is applied in user space by `relay.py` and only `rtt_ms` is kept here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

# Mbit/s down, Mbit/s up: typical consumer plans, so benchmarks can name a link instead of two numbers.
PRESETS: dict[str, tuple[float | None, float | None]] = {
    "fiber": (300.0, 300.0),
    "cable": (200.0, 20.0),
    "dsl": (16.0, 1.0),
    "lte": (50.0, 10.0),
    "lan": (None, None),
}

_UNITS = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "": 1.0}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit)?(?:/s|ps)?\s*$", re.IGNORECASE)
_TIME_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$", re.IGNORECASE)
_NO_CAP = {"none", "unlimited", "inf", "-"}


@dataclass(frozen=True)
class LinkProfile:
    """One host's access link: download/upload caps in Mbit/s (None = uncapped) and its RTT share.

    `rtt_ms` is the round trip this link contributes: two hosts whose links have `rtt_ms` a and b see
    an RTT of (a + b) / 2 through the relay, so giving every link 40 ms means every pair sees 40 ms.
    `queue_ms` sizes the shaper's queue (how much bufferbloat the home router has).
    """

    down_mbit: float | None = None
    up_mbit: float | None = None
    rtt_ms: float = 0.0
    name: str = "custom"
    queue_ms: float = 50.0

    def __post_init__(self) -> None:
        for rate in (self.down_mbit, self.up_mbit):
            if rate is not None and rate <= 0:
                raise ValueError(f"link rates must be positive or None: {self}")
        if self.rtt_ms < 0 or self.queue_ms <= 0:
            raise ValueError(f"rtt_ms must be >= 0 and queue_ms > 0: {self}")

    def with_rtt(self, rtt_ms: float) -> LinkProfile:
        """Copy with another RTT, so a CLI-wide `--rtt` can fill in profiles that did not set one."""
        return replace(self, rtt_ms=rtt_ms)

    def describe(self) -> str:
        """Short human label, e.g. `cable 200/20 Mbit/s, 40 ms`."""

        def fmt(rate: float | None) -> str:
            return "inf" if rate is None else f"{rate:g}"

        return f"{self.name} {fmt(self.down_mbit)}/{fmt(self.up_mbit)} Mbit/s, {self.rtt_ms:g} ms"


def parse_rate_mbit(text: str) -> float | None:
    """`50mbit`, `1.5gbit`, `800kbit` or a bare number of Mbit/s; `none`/`unlimited` give None."""
    if text.strip().lower() in _NO_CAP:
        return None
    match = _RATE_RE.match(text)
    if not match:
        raise ValueError(f"bad rate {text!r}: expected e.g. 50mbit, 800kbit, 1gbit or 50")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value <= 0:
        raise ValueError(f"rate must be positive: {text!r}")
    return value


def parse_duration_ms(text: str) -> float:
    """`40ms`, `0.04s`, `500us` or a bare number of milliseconds."""
    match = _TIME_RE.match(text)
    if not match:
        raise ValueError(f"bad duration {text!r}: expected e.g. 40ms, 0.04s or 40")
    scale = {"ms": 1.0, "": 1.0, "s": 1000.0, "us": 1e-3}[(match.group(2) or "").lower()]
    return float(match.group(1)) * scale


def parse_link(spec: str, rtt_ms: float = 0.0) -> LinkProfile:
    """Parse a link spec from the command line.

    Accepted: `50mbit` (symmetric), `200/20` (down/up Mbit/s), `cable` (a preset), `cable:200/20`
    (named, explicit rates), `lan`/`unlimited` (no cap), each optionally followed by `@40ms` to set
    this link's RTT; without it `rtt_ms` applies.
    """
    body, _, rtt_text = spec.strip().partition("@")
    if rtt_text:
        rtt_ms = parse_duration_ms(rtt_text)
    name, colon, rates = body.partition(":")
    if not colon:
        name, rates = "", body
    name, rates = name.strip().lower(), rates.strip()
    if not name and rates.lower() in PRESETS:
        name, rates = rates.lower(), ""
    if not rates:
        if name not in PRESETS:
            raise ValueError(f"unknown link preset {name!r}; known: {', '.join(PRESETS)}")
        down, up = PRESETS[name]
        return LinkProfile(down, up, rtt_ms, name)
    if "/" in rates:
        down_text, up_text = rates.split("/", 1)
        down, up = parse_rate_mbit(down_text), parse_rate_mbit(up_text)
    else:
        down = up = parse_rate_mbit(rates)
    return LinkProfile(down, up, rtt_ms, name or ("unlimited" if down is None and up is None else "link"))


@dataclass(frozen=True)
class TbfParams:
    """Token-bucket parameters for one direction, in the units `tc` takes (bit/s and bytes)."""

    rate_bit: int
    burst_bytes: int
    limit_bytes: int


def tbf_params(rate_mbit: float, queue_ms: float) -> TbfParams:
    """Size the bucket and queue for a rate.

    The bucket must hold at least a few ms of traffic or the shaper undershoots at high rates (the
    qdisc watchdog cannot fire more often than that), and at least a few full-size packets so slow
    links still pass them. The queue holds `queue_ms` of traffic, like a home router's buffer.
    """
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(int(rate_bytes * 0.004), 16 * 1024)
    limit = max(int(rate_bytes * queue_ms / 1000), 2 * burst)
    return TbfParams(int(rate_mbit * 1e6), burst, limit)


def shape_command(netns: str, dev: str, rate_mbit: float | None, queue_ms: float) -> list[str] | None:
    """`tc` argv that caps egress of `dev` inside `netns`, or None when the direction is uncapped."""
    if rate_mbit is None:
        return None
    p = tbf_params(rate_mbit, queue_ms)
    return [
        "tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
        "rate", f"{p.rate_bit}bit", "burst", str(p.burst_bytes), "limit", str(p.limit_bytes),
    ]  # fmt: skip
