import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, intermediate_size=128,
              norm_topk_prob=True, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def tiny_moe(seed: int = 0, **overrides):
    """A tiny random Qwen3-MoE in fp32 (16 experts, top-4), built in code."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(**overrides)).eval()
    # random init gives near-uniform routers; sharpen them so routes differ between tokens
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(8.0)
    return model


@pytest.fixture
def model():
    return tiny_moe()
