"""bf16, fp16 and fp32 against plain transformers on a tiny random target: the prompt's forward on an enabled model
is bit-identical to plain's, whatever the slot cache holds."""

import pytest
import torch
from conftest import tiny_moe

import specfit

PROMPTS = [torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (20, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_prompts_forward_is_bit_identical_to_plain_whatever_the_slots_hold(dtype):
    """Every position's logits of a 50-token forward, at 2 slot counts and after another prompt filled the slots:
    each expert multiplies exactly its own rows, as transformers' grouped experts do, so nothing depends on which
    experts shared a group. Fails when a group's rows are padded to its busiest expert's count."""
    prompt = torch.randint(2, 256, (1, 50), generator=torch.Generator().manual_seed(50))
    with torch.no_grad():
        want = tiny_moe().to(dtype)(prompt).logits
        for slots in (2, 6):
            model = specfit.enable(tiny_moe().to(dtype), cache_slots=slots)
            for other in (None, PROMPTS[0]):
                if other is not None:
                    model(other)
                assert torch.equal(model(prompt).logits, want), (slots, other is None)
