"""The one folder that touches transformers internals: its faces, one file each.

Everything here relies on details of transformers 5.x that are not public API: the experts-implementation registry
and ``config._experts_implementation``, the layout of Qwen3-MoE decoder layers, the tensors inside cache layers, and
how ``generate()`` builds a call's generation config. (The private ``_sample`` method that ``generate()`` dispatches
to is named in ``decoding/strategy.py``, the one class that overrides it.) When transformers moves, this folder
moves. It is the bottom layer: it imports nothing of SpecFit's outside itself.

- ``experts``: transformers' experts interface (the ``"specfit"`` implementation, the experts' math).
- ``layers``: finding the MoE layers and their experts' tensors (``MoELayer``, ``ExpertLayout``, ``moe_layers``).
- ``routers``: how each family's router picks experts (``RouterRule``, ``router_rule``).
- ``kv_cache``: the KV cache and masks tree decoding needs (``keep_kv``, ``crop_kv``, ``layer_masks``, checks).
- ``generation``: ``generate()`` plumbing (a call's generation config, stopping criteria read on the host).
- ``checkpoints``: checkpoint keys, quantization, and ``save_pretrained`` with the experts outside the parameters.

This package imports none of them: callers import the face they use (``from specfit.seam import kv_cache``).
"""
