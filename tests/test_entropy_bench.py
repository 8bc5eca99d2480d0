"""The two yardsticks of ``benchmarks/entropy.py``: the Gaussian distortion-rate bound and the energy shares."""

import math

import torch

from benchmarks.entropy import energy_shares, gaussian_bound


def test_the_bound_is_shannons_distortion_rate_for_a_gaussian() -> None:
    assert gaussian_bound(0.0) == 1.0  # nothing sent: the error is the signal
    assert math.isclose(gaussian_bound(2.0), 0.25)  # each bit halves the error's norm
    # an optimal uniform scalar quantiser at 8 bits sits above the bound, never below it
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    step = 2 * 4 * x.std() / 255
    q = torch.clamp(torch.round(x / step), -127, 127) * step
    assert float((q - x).norm() / x.norm()) > gaussian_bound(8.0)


def test_energy_shares_see_a_low_rank_matrix() -> None:
    g = torch.Generator().manual_seed(1)
    low = torch.randn(512, 4, generator=g) @ torch.randn(4, 256, generator=g)  # rank 4
    assert [round(v, 6) for v in energy_shares(low.view(4, 128, 256), (4, 8))] == [1.0, 1.0]
    full = torch.randn(4, 128, 256, generator=g)  # no structure: 8 of 256 directions hold little
    assert energy_shares(full, (8,))[0] < 0.1
