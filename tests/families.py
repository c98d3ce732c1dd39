"""Tiny random models of every MoE family transformers 5 ships with routed experts, built in code from its own
config classes (fp32, CPU, 4 layers, hidden 64, 8 experts), and the real checkpoint each stands for."""

import torch

COMMON = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
              pad_token_id=0)
V3 = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
          first_k_dense_replace=1, n_group=4, topk_group=2)

# family -> (config overrides, real checkpoint it stands for)
FAMILIES = {
    "qwen3_moe": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32), "Qwen/Qwen3-30B-A3B"),
    "qwen2_moe": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48), "Qwen/Qwen1.5-MoE-A2.7B"),
    "mixtral": (dict(num_local_experts=8, num_experts_per_tok=2), "mistralai/Mixtral-8x7B-v0.1"),
    "olmoe": (dict(num_experts=8, num_experts_per_tok=2), "allenai/OLMoE-1B-7B-0924"),
    "deepseek_v2": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                         num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16), "deepseek-ai/DeepSeek-V2-Lite"),
    "deepseek_v3": (dict(V3, num_key_value_heads=4, head_dim=8, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16), "deepseek-ai/DeepSeek-V3"),
    "glm4_moe": (dict(V3), "zai-org/GLM-4.5-Air"),
    "ernie4_5_moe": (dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                          moe_layer_start_index=1), "baidu/ERNIE-4.5-21B-A3B-PT"),
    "dots1": (dict(V3), "rednote-hilab/dots.llm1.inst"),
    "hunyuan_v1_moe": (dict(num_experts=8, moe_topk=2), "tencent/Hunyuan-A13B-Instruct"),
    "gpt_oss": (dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=8), "openai/gpt-oss-20b"),
    "phimoe": (dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=131072),
               "microsoft/Phi-3.5-MoE-instruct"),
    "granitemoe": (dict(num_local_experts=8, num_experts_per_tok=2), "ibm-granite/granite-3.1-3b-a800m-instruct"),
    "granitemoeshared": (dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48),
                         "ibm-research/moe-7b-1b-active-shared-experts"),
    "llama4_text": (dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                         attention_chunk_size=8, interleave_moe_layer_step=2),
                    "meta-llama/Llama-4-Scout-17B-16E-Instruct"),
    "granitemoehybrid": (dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48,
                              layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=4,
                              mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16),
                         "ibm-granite/granite-4.0-h-tiny"),
    "qwen3_next": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, linear_num_value_heads=4, linear_num_key_heads=2,
                        linear_key_head_dim=16, linear_value_head_dim=16), "Qwen/Qwen3-Next-80B-A3B-Instruct"),
    "minimax": (dict(num_local_experts=8, num_experts_per_tok=2, block_size=16), "MiniMaxAI/MiniMax-Text-01"),
}
HYBRID = ("granitemoehybrid", "qwen3_next", "minimax")  # linear attention / mamba: assistants refused
# no sdpa kernel (GPT-OSS has attention sinks): eager
EAGER = ("gpt_oss",)


def config(family: str, **overrides):
    from transformers import AutoConfig

    kw, _ = FAMILIES[family]
    cfg = AutoConfig.for_model(family, **{**COMMON, **kw, **overrides})
    cfg._attn_implementation = "eager" if family in EAGER else "sdpa"
    return cfg


def tiny(family: str, seed: int = 0, **overrides):
    """A tiny random model of ``family``; routers sharpened (x8) so routes differ between tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight", "gate.wg.weight")):
                p.mul_(8.0)
            elif name.endswith("bias") and ("experts" in name or "router" in name):
                p.normal_(0, 0.1)  # GPT-OSS expert and router biases start at zero: make them count
    return model
