"""Peers behind NAT are kept apart (pure rule; placement applies it, the lab test runs it for real)."""

from __future__ import annotations

import pytest

from coordinator.reachability import Unarrangeable, arrange, conflicts


def test_unreachable_peers_are_separated_with_few_moves() -> None:
    reach = {"a": True, "b": False, "c": False, "d": True}
    order = arrange(["a", "b", "c", "d"], reach)
    assert conflicts(order, reach) == []
    assert sorted(order) == ["a", "b", "c", "d"]
    assert arrange(["b", "a", "c", "d"], reach) == ["b", "a", "c", "d"]  # already fine: untouched


def test_too_many_unreachable_peers_are_reported_not_hung() -> None:
    with pytest.raises(Unarrangeable, match="behind NAT"):
        arrange(["a", "b", "c", "d"], {"a": False, "b": False, "c": True, "d": False})
    order = arrange(["a", "b", "c"], {"a": False, "b": False, "c": True})
    assert order == ["a", "c", "b"]  # one move: b trades places with c, the only reachable peer
