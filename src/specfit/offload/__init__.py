"""Stage 1, the offload: routed experts in host arenas, a slot cache per MoE layer on the device, the copies between
them (CUDA copy stream or an emulated link), the ``"specfit"`` experts function, route recording and the streaming
loader. Depends on ``seam`` and ``stats`` only."""
