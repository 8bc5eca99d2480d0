"""Typed configs <-> control-plane protobuf, in one place so both ends agree field by field."""

from __future__ import annotations

from swarm.config import WIRE_AUTO, HFConfig, ModelConfig, TrainConfig
from swarm.pb import control_pb2 as cpb
from swarm.wire.packets import WireError, codec_from_pb, codec_to_pb


def _wire_to_pb(choice: str) -> tuple[int, bool]:
    """(codec, auto): ``auto`` leaves the codec unset, since each link's is in the sealed plan."""
    return (0, True) if choice == WIRE_AUTO else (codec_to_pb(choice), False)


def _wire_from_pb(codec: int, auto: bool, flag: str) -> str:
    if auto and codec:
        raise WireError(f"TrainConfig sets both {flag} auto and a codec ({codec_from_pb(codec)}); pick one")
    return WIRE_AUTO if auto else codec_from_pb(codec)


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
        n_layers=m.n_layers,
        d_model=m.d_model,
        n_heads=m.n_heads,
        vocab_size=m.vocab_size,
        context=m.context,
        seed=m.seed,
    )


def train_to_pb(cfg: TrainConfig) -> cpb.TrainConfig:
    (forward, forward_auto), (backward, backward_auto) = _wire_to_pb(cfg.wire_forward), _wire_to_pb(cfg.wire_backward)
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
        wire_forward=forward,
        wire_backward=backward,
        wire_forward_auto=forward_auto,
        wire_backward_auto=backward_auto,
        error_feedback_backward=cfg.error_feedback_backward == "on",
        error_feedback_backward_auto=cfg.error_feedback_backward == "auto",
        wire_zstd=cfg.wire_zstd,
        wire_rank=cfg.wire_rank,
        warmup_steps=cfg.warmup_steps,
        lr_decay_steps=cfg.lr_decay_steps,
        sync_steps=cfg.sync_steps,
        grad_clip=cfg.grad_clip,
        max_staleness=cfg.max_staleness,
        max_in_flight=cfg.max_in_flight,
        checkpoint_every=cfg.checkpoint_every,
        average_every=cfg.average_every,
        average_codec=codec_to_pb(cfg.average_codec),
        outer_lr=cfg.outer_lr,
        outer_momentum=cfg.outer_momentum,
        average_timeout=cfg.average_timeout,
        train_samples=cfg.train_samples,
        wire_forward_delta=cfg.wire_forward_delta,
        delta_cache_bytes=cfg.delta_cache_bytes,
        delta_spill_bytes=cfg.delta_spill_bytes,
    )


def _feedback_mode(t: cpb.TrainConfig) -> str:
    if t.error_feedback_backward_auto:
        return "auto"
    return "on" if t.error_feedback_backward else "off"


def train_from_pb(t: cpb.TrainConfig, steps: int = 0) -> TrainConfig:
    return TrainConfig(
        steps=steps,
        micro_batches=t.micro_batches,
        micro_batch_size=t.micro_batch_size,
        lr=t.lr,
        weight_decay=t.weight_decay,
        warmup_steps=int(t.warmup_steps),
        lr_decay_steps=t.lr_decay_steps,
        sync_steps=t.sync_steps,
        grad_clip=t.grad_clip,
        data=t.data,
        data_seed=t.data_seed,
        eval_every=t.eval_every,
        eval_batches=t.eval_batches,
        schedule=t.schedule,
        wire_forward=_wire_from_pb(t.wire_forward, t.wire_forward_auto, "--wire-forward"),
        wire_backward=_wire_from_pb(t.wire_backward, t.wire_backward_auto, "--wire-backward"),
        error_feedback_backward="auto"
        if t.error_feedback_backward_auto
        else "on"
        if t.error_feedback_backward
        else "off",
        wire_zstd=t.wire_zstd,
        wire_rank=t.wire_rank or TrainConfig.wire_rank,
        max_staleness=t.max_staleness,
        max_in_flight=t.max_in_flight,
        checkpoint_every=t.checkpoint_every,
        average_every=t.average_every or 10,
        average_codec=codec_from_pb(t.average_codec) if t.average_codec else "int8",
        outer_lr=t.outer_lr or 1.0,
        outer_momentum=t.outer_momentum,
        average_timeout=t.average_timeout or 30.0,
        train_samples=t.train_samples,
        wire_forward_delta=t.wire_forward_delta,
        delta_cache_bytes=t.delta_cache_bytes,
        delta_spill_bytes=t.delta_spill_bytes,
    )


def hf_to_pb(cfg: HFConfig) -> cpb.HFConfig:
    return cpb.HFConfig(
        path=cfg.path,
        dtype=cfg.dtype,
        quant=cfg.quant,
        activation_checkpointing=cfg.activation_checkpointing,
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_targets=list(cfg.lora_targets),
        config_sha256=cfg.config_sha256,
    )


def hf_from_pb(h: cpb.HFConfig) -> HFConfig:
    return HFConfig(
        path=h.path,
        dtype=h.dtype,
        quant=h.quant or "none",
        activation_checkpointing=h.activation_checkpointing,
        lora_rank=h.lora_rank,
        lora_alpha=h.lora_alpha,
        lora_targets=tuple(h.lora_targets),
        config_sha256=h.config_sha256,
    )


def assignment_configs(a: cpb.Assignment) -> tuple[ModelConfig, TrainConfig, HFConfig | None]:
    """The model, recipe and (when fine-tuning) checkpoint an assignment carries."""
    return model_from_pb(a.model), train_from_pb(a.train), hf_from_pb(a.hf) if a.HasField("hf") else None
