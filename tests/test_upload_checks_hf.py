"""Issue 16 item 6 for Hugging Face blocks: an LoRA block's upload is checked name by name too.

The coordinator derives the adapters' names and shapes from the checkpoint's config (no weights read);
this must match what a real ``HFStageModel`` uploads, or honest checkpoints would be refused.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch  # noqa: E402

from coordinator.upload_checks import hf_block_spec, max_upload_bytes  # noqa: E402
from swarm.config import MODEL_PRESETS, HFConfig  # noqa: E402
from swarm.pb import control_pb2 as cpb  # noqa: E402
from swarm.train.hf import HFStageModel  # noqa: E402
from swarm.train.hf.tiny import ARCHS, make_tiny_checkpoint  # noqa: E402
from swarm.wire.packets import WireError, tensor_to_pb  # noqa: E402
from swarm.wire.state_checks import decode_state  # noqa: E402


def upload(tensors: dict[str, torch.Tensor], start: int, end: int) -> cpb.StateChunk:
    chunk = cpb.StateChunk(peer_id="p1", stage=1, version=5, layer_start=start, layer_end=end, periodic=True)
    for name, t in tensors.items():
        chunk.tensors.add(name=name, tensor=tensor_to_pb(t.float(), "fp32"))
    return chunk


@pytest.mark.parametrize("arch", ARCHS)
def test_the_spec_of_an_hf_block_is_what_its_peer_uploads(tmp_path, arch: str) -> None:
    path = make_tiny_checkpoint(tmp_path / arch, arch)
    hf = HFConfig(path=str(path), dtype="fp32", lora_rank=4)
    block = HFStageModel(path, 1, 3, dtype=torch.float32, lora_rank=4, lora_alpha=hf.lora_alpha)
    real = block.trainable_state_dict()
    spec = hf_block_spec(hf, 1, 3)
    assert spec.shapes == {k: tuple(v.shape) for k, v in real.items()}
    weights, _ = decode_state(upload(real, 1, 3), spec)  # an honest upload passes
    assert set(weights) == set(real)
    assert max_upload_bytes(MODEL_PRESETS["gpt-tiny"], hf, [(0, 1), (1, 3)]) >= spec.max_state_bytes


def test_a_bad_hf_upload_is_refused_before_decoding(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    hf = HFConfig(path=str(path), dtype="fp32", lora_rank=4)
    real = HFStageModel(path, 0, 2, dtype=torch.float32, lora_rank=4).trainable_state_dict()
    spec = hf_block_spec(hf, 0, 2)
    name = next(iter(real))
    cases = {
        "does not match": {**real, name: torch.zeros(4096, 4096)},  # an oversized adapter
        "not part of this block": {**real, "model.layers.3.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)},
        "lacks 1 parameter": {k: v for k, v in real.items() if k != name},
        "NaN or Inf": {**real, name: torch.full_like(real[name], float("nan"))},
    }
    for why, tensors in cases.items():
        chunk = upload({}, 0, 2)
        for n, t in tensors.items():
            chunk.tensors.add(name=n, tensor=tensor_to_pb(t, "fp32", allow_nonfinite=True))
        with pytest.raises(WireError, match=why):
            decode_state(chunk, spec)
    # the cap at the first frame follows the block: adapters of a rank-4 tiny model, far below the old 8 GiB
    assert spec.max_state_bytes < 1 << 20
