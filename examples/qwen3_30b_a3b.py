"""Qwen3-30B-A3B on one CUDA GPU with 48 expert slots per layer (the paper's setting).

    specfit calibrate --model Qwen/Qwen3-30B-A3B --drafter <eagle3-drafter> --slots 48   # once per GPU
    python examples/qwen3_30b_a3b.py --drafter <eagle3-drafter>

Needs a CUDA GPU with ~24 GB free and ~60 GB of host RAM (54 GiB of experts are pinned in place). Public EAGLE-3
drafters for this model (SpecForge/SGLang or vLLM/speculators layouts) load as they are, e.g.
`Tengyunw/qwen3_30b_moe_eagle3` or `AngelSlim/Qwen3-a3B_eagle3` from the hub.
"""

import argparse

from transformers import AutoTokenizer

import specfit

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="Qwen/Qwen3-30B-A3B")
parser.add_argument("--drafter", required=True)
parser.add_argument("--slots", type=int, default=48)
parser.add_argument("--max-new-tokens", type=int, default=256)
args = parser.parse_args()

model = specfit.from_pretrained(args.model, cache_slots=args.slots, drafter=args.drafter)
print(model.specfit)  # pinned bytes vs weight bytes, slots, device
tokenizer = AutoTokenizer.from_pretrained(args.model)
messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                                        "many clips in May. How many clips did Natalia sell altogether?"}]
# return_dict=True: the encoding (input_ids and attention_mask), whatever the transformers version returns by default
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                       return_dict=True, return_tensors="pt").to(model.device)
prompt_length = inputs["input_ids"].shape[1]
for assistant in (None, "eagle3", "specfit"):
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, assistant=assistant)
    g = model.specfit.stats.last_generate
    print(f"{assistant or 'AR':8} {g.tokens_per_second:6.2f} tok/s  {g.copies_per_token:6.1f} copies/token  "
          f"{g.nodes_per_cycle:4.2f} nodes/cycle  {g.tokens_per_cycle:4.2f} tokens/cycle")
print(tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True))
