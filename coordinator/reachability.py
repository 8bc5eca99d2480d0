"""Keep a reachable peer at every pipeline boundary (the NAT rule of ``coordinator/placement.py``).

Between two neighbouring stages one side must accept a connection. A peer behind home NAT cannot, so
two such peers must never be neighbours: ``arrange`` reorders a chain of peers, before placement sizes
their blocks, until every boundary has a reachable side, or explains why that is impossible. Who then
dials whom is derived from the signed plan by ``swarm.dht.plan_view``. Pure functions, tested alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class Unarrangeable(ValueError):
    """More peers are behind NAT than can be kept apart; the message names them."""


def conflicts(order: Sequence[str], reachable: Mapping[str, bool]) -> list[int]:
    """Boundaries i (between order[i] and order[i+1]) where neither side accepts connections."""
    return [i for i in range(len(order) - 1) if not reachable[order[i]] and not reachable[order[i + 1]]]


def arrange(order: Sequence[str], reachable: Mapping[str, bool]) -> list[str]:
    """``order`` with as few peers moved as possible so that no two unreachable peers are adjacent."""
    order = list(order)
    unreachable = sum(1 for p in order if not reachable[p])
    if unreachable > (len(order) + 1) // 2:
        raise Unarrangeable(
            f"{unreachable} of {len(order)} peers are behind NAT ({', '.join(p for p in order if not reachable[p])}); "
            "at most half (rounded up) can be kept apart by reachable neighbours. Add reachable peers or open a port "
            "(relaying through a volunteer is not available yet)"
        )
    for _ in range(len(order) ** 2):  # bounded: each swap removes a conflict or we fall through
        bad = conflicts(order, reachable)
        if not bad:
            return order
        i = bad[0] + 1
        for j in range(len(order)):
            if j in (i - 1, i) or not reachable[order[j]]:
                continue
            trial = order.copy()
            trial[i], trial[j] = trial[j], trial[i]
            if len(conflicts(trial, reachable)) < len(bad):
                order = trial
                break
        else:
            break
    if conflicts(order, reachable):  # fall back to a plain alternation
        good = [p for p in order if reachable[p]]
        poor = [p for p in order if not reachable[p]]
        order = []
        while poor or good:
            if poor:
                order.append(poor.pop(0))
            if good:
                order.append(good.pop(0))
        if conflicts(order, reachable):
            raise Unarrangeable("no order keeps a reachable peer at every boundary")
    return order
