"""A tiny Llama (built from a config, never downloaded) trained one step under FSDP2,
for the safetensors tests and the recipe."""

from __future__ import annotations

import os
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENS = torch.tensor([[1, 5, 9, 17, 33, 2, 7, 64]])


def tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def train_one_step_fsdp2(model: Any) -> torch.optim.Optimizer:
    """Shard ``model`` with FSDP2 (each layer, then the root) and take one AdamW step."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(input_ids=TOKENS, labels=TOKENS).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return optim
