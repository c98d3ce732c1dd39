import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(1)  # tiny models: one thread is fastest, and immune to a busy second core


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


@pytest.fixture(scope="module")
def standin_embedded():
    """(model, tokenizer): the embedded model and drafter enabled under the CUDA stand-in, on its device (distinct
    from the host: ``specfit.offload.standin_device``), one thread."""
    from specfit import embedded
    from specfit.offload import standin, standin_device

    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(standin.ENV, "1")
        model, tokenizer = embedded.load(32)
    assert standin_device.is_device(model.device) and model.specfit.cuda
    return model, tokenizer


class SelfDrafter(torch.nn.Module):
    """A test double with the Eagle3Drafter interface that drafts with a copy of the target itself: its draft
    probabilities are the target's own, so its top-1 token is the target's greedy token. With ``noise`` > 0 a node's
    prediction is replaced by random logits with that probability, which makes acceptance partial. ``sharpen``
    multiplies the copy's logits, making its draft probabilities more confident.

    The drafter protocol never shows it token 0 of the prompt (pairs are (feature of t_i, t_{i+1})), so the copy is
    told it up front: ``first_token``.
    """

    def __init__(self, target, first_token: int, noise: float = 0.0, seed: int = 0, sharpen: float = 1.0):
        super().__init__()
        import copy
        from types import SimpleNamespace

        from transformers import DynamicCache

        self.target = copy.deepcopy(target).eval()
        self.first_token, self.noise, self.sharpen = first_token, noise, sharpen
        self.generator = torch.Generator().manual_seed(seed)
        self.config = SimpleNamespace(aux_layer_ids=(0, 1, 2), hidden_size=target.config.hidden_size)
        self.fc = torch.nn.Linear(1, 1)
        self.embed_tokens = None
        self.kv = DynamicCache(config=self.target.config)

    def set_embedding(self, embedding):
        pass

    def to_target_ids(self, draft_ids):
        return draft_ids

    def forward(self, input_ids, hidden, position_ids, cache=None, attention_mask=None):
        n = len(cache)
        extra = self.kv.get_seq_length() - (n + 1)
        if extra > 0:
            self.kv.crop(-extra)
        device = input_ids.device  # the target's (a GPU, or the CUDA stand-in's device)
        if n == 0 and self.kv.get_seq_length() == 0:
            self.target(torch.tensor([[self.first_token]], device=device), cache=self.kv, use_cache=True)
        if attention_mask is not None:  # the copy's KV has token 0 in front of the drafter's entries
            attention_mask = torch.cat([torch.zeros_like(attention_mask[..., :1]), attention_mask], dim=-1)
        with torch.no_grad():
            logits = self.target(input_ids, cache=self.kv, position_ids=position_ids + 1,
                                 attention_mask=attention_mask, use_cache=True).logits * self.sharpen
        if self.noise:  # drawn on the host (the same draws on any device), then moved
            flip = torch.rand(logits.shape[:2], generator=self.generator) < self.noise
            noise = torch.randn(logits.shape, generator=self.generator) * 3
            logits = torch.where(flip[..., None].to(device), noise.to(device), logits)
        T = input_ids.shape[1]
        cache.append(torch.zeros(1, 1, T, 1, device=device), torch.zeros(1, 1, T, 1, device=device))
        return logits, torch.zeros(1, T, self.config.hidden_size, device=device)
