"""Typed configs <-> control-plane protobuf, in one place so both ends agree field by field."""

from __future__ import annotations

from swarm.config import ModelConfig, TrainConfig
from swarm.pb import control_pb2 as cpb
from swarm.wire import codec_from_pb, codec_to_pb


def model_to_pb(cfg: ModelConfig) -> cpb.ModelConfig:
    return cpb.ModelConfig(
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        vocab_size=cfg.vocab_size,
        context=cfg.context,
        seed=cfg.seed,
    )


def model_from_pb(m: cpb.ModelConfig) -> ModelConfig:
    return ModelConfig(
        n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, vocab_size=m.vocab_size, context=m.context,
        seed=m.seed,
    )


def train_to_pb(cfg: TrainConfig) -> cpb.TrainConfig:
    return cpb.TrainConfig(
        micro_batches=cfg.micro_batches,
        micro_batch_size=cfg.micro_batch_size,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        data_seed=cfg.data_seed,
        data=cfg.data,
        eval_every=cfg.eval_every,
        eval_batches=cfg.eval_batches,
        schedule=cfg.schedule,
        wire_forward=codec_to_pb(cfg.wire_forward),
        wire_backward=codec_to_pb(cfg.wire_backward),
        warmup_steps=cfg.warmup_steps,
        grad_clip=cfg.grad_clip,
    )


def train_from_pb(t: cpb.TrainConfig, steps: int = 0) -> TrainConfig:
    return TrainConfig(
        steps=steps,
        micro_batches=t.micro_batches,
        micro_batch_size=t.micro_batch_size,
        lr=t.lr,
        weight_decay=t.weight_decay,
        warmup_steps=int(t.warmup_steps),
        grad_clip=t.grad_clip,
        data=t.data,
        data_seed=t.data_seed,
        eval_every=t.eval_every,
        eval_batches=t.eval_batches,
        schedule=t.schedule,
        wire_forward=codec_from_pb(t.wire_forward),
        wire_backward=codec_from_pb(t.wire_backward),
    )


def assignment_configs(a: cpb.Assignment) -> tuple[ModelConfig, TrainConfig]:
    """The model and recipe an assignment carries; raises ValueError for inconsistent values."""
    return model_from_pb(a.model), train_from_pb(a.train)
