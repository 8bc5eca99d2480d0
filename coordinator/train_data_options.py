"""Options of a fixed training set, and of the activation deltas it makes possible.

A fine-tuning set is small and seen for several epochs; ``--train-samples N`` trains that way on any data
(N sequences, a fresh order each epoch), and ``--wire-forward-delta CODEC`` then sends the activation of
a sample seen before as its change since that visit (swarm/wire/sample_deltas.py; docs/codecs.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Annotated

import typer

from coordinator.option_checks import check_choice, config_error
from swarm.config import DELTA_CODECS

MIB = 1 << 20


@dataclass(frozen=True)
class TrainDataOptions:
    train_samples: int = 0
    wire_forward_delta: str = "off"
    delta_cache_mib: int = 1024
    delta_spill_mib: int = 0

    def train_config_fields(self) -> dict:
        """The ``TrainConfig`` fields these options set."""
        if self.wire_forward_delta != "off" and not self.train_samples:
            config_error("--wire-forward-delta needs samples that return: add --train-samples N")
        return {
            "train_samples": self.train_samples,
            "wire_forward_delta": "" if self.wire_forward_delta == "off" else self.wire_forward_delta,
            "delta_cache_bytes": self.delta_cache_mib * MIB,
            "delta_spill_bytes": self.delta_spill_mib * MIB,
        }


def train_data_options(
    train_samples: Annotated[
        int,
        typer.Option(
            min=0,
            help="Train on a fixed set of N sequences of --data, seen epoch after epoch in a fresh order, as a "
            "fine-tuning set is (0: a fresh window for every sequence).",
        ),
    ] = 0,
    wire_forward_delta: Annotated[
        str,
        typer.Option(
            help=f"With --train-samples: send a sample's activation as its change since its last visit, in this "
            f"codec ({', '.join(DELTA_CODECS)}), where both sides of the link hold its last row (AQ-SGD; the first "
            "visit travels in the link's own codec). ecsq keeps int4_rot's precision and sends less the less a "
            "sample moved: LoRA fine-tuning, 3 seeds, 12.4x fewer bytes than fp32 instead of 10.4x at no measured "
            "loss (docs/codecs.md); 'off': never.",
            callback=lambda v: check_choice(v, ("off", *DELTA_CODECS), "delta codec"),
        ),
    ] = "off",
    delta_cache_mib: Annotated[
        int,
        typer.Option(min=0, help="Activation deltas: MiB of rows each side of a link holds in memory (bf16)."),
    ] = 1024,
    delta_spill_mib: Annotated[
        int,
        typer.Option(
            min=0,
            help="Activation deltas: MiB of rows each side of a link holds on disk beyond --delta-cache-mib, in "
            "an unlinked temporary file; samples beyond both travel whole.",
        ),
    ] = 0,
) -> TrainDataOptions:
    return TrainDataOptions(train_samples, wire_forward_delta, delta_cache_mib, delta_spill_mib)


TRAIN_DATA_PARAMS = list(inspect.signature(train_data_options, eval_str=True).parameters.values())
