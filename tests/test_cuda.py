"""The CUDA paths: pinned arenas, the device slot cache, the copy stream, tree decoding and the loader on a GPU.

Every test is marked ``cuda`` and skips on a machine without one; ``tests/gpu/gpu_check.py`` runs them on the
device machine (``pytest -m cuda tests/test_cuda.py``) with ``SPECFIT_REQUIRE_CUDA=1``, which turns the skip into an
error: a GPU check must not pass with every test skipped.

Exact-token asserts use prompts whose greedy trajectory has a clear margin (top-1 over top-2 score, and every
router's k-th over (k+1)-th probability, measured on the CPU reference): a near-tie could be broken differently by
kernels of another batch shape, which is not a SpecFit error.
"""

import functools
import gc
import itertools
import os
import warnings

import numpy as np
import pytest
import torch
from conftest import tiny_moe, tiny_moe_config
from transformers import AutoModelForCausalLM

import specfit
from specfit.selection.cost_model import CostModel
from specfit.patch import configure
from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter
from specfit.offload.cache import CopyEngine, LayerCache
from specfit.offload.experts import LayerRuntime
from specfit.offload.store import ExpertStore
from specfit.stats import Counters

if os.environ.get("SPECFIT_REQUIRE_CUDA") == "1" and not torch.cuda.is_available():
    raise RuntimeError("SPECFIT_REQUIRE_CUDA=1 but torch.cuda.is_available() is False: the CUDA tests cannot run")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]

E, K = 16, 4  # the tiny model's experts and top-k
FREE_NODES = CostModel(intercepts=(1.0,) * 8, beta=0.0)  # nodes cost nothing: SpecFit verifies full subtrees too
SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: ~0.5 s of GPU time at ~2 GHz, far longer than one expert copy


def cuda_model(seed=0):
    """The tiny model on the GPU, on transformers' eager experts loop: its fused grouped_mm path may not take fp32."""
    model = tiny_moe(seed).cuda()
    model.set_experts_implementation("eager")
    return model


def cuda_logits(model, ids):
    with torch.no_grad():
        return model(ids.cuda()).logits


def margin(model, ids, new_tokens):
    """The smallest top-1 over top-2 greedy score gap along ``new_tokens`` steps from ``ids``, and the smallest gap
    between any router's k-th and (k+1)-th probability over the whole sequence (CPU reference, fp32)."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        token_gap = min(float(g[0] - g[1]) for g in (s[0].topk(2).values for s in out.scores))
        router = model(out.sequences, output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    top = torch.stack([torch.softmax(r.float(), -1).topk(k + 1, dim=-1).values for r in router])  # [L, T, k+1]
    return token_gap, float((top[..., k - 1] - top[..., k]).min())


@functools.lru_cache(maxsize=None)
def clear_prompt(length, new_tokens, seed=0, first=0):
    """A prompt of ``length`` random ids whose greedy trajectory has clear margins (see ``margin``)."""
    model = tiny_moe(seed)
    for s in range(first, first + 200):
        ids = torch.randint(2, 256, (1, length), generator=torch.Generator().manual_seed(s))
        token_gap, router_gap = margin(model, ids, new_tokens)
        if token_gap > 1e-2 and router_gap > 1e-4:
            return ids
    raise AssertionError(f"no prompt of length {length} with clear margins among 200 seeds")


def host_allocator_bytes():
    """Bytes held by torch's pinned (caching host) allocator, or None if this torch does not report them."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return None if stats is None else stats().get("allocated_bytes.current")


# --- host arenas --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, experts, hidden, intermediate", [
    (3, 5, 64, 48),  # odd sizes: a power-of-two rounding would show
    (1, 128, 2048, 768),  # one real Qwen3-30B-A3B layer: 128 x 9,437,184 bytes = 1.125 GiB (2 GiB if rounded)
])
def test_pinned_arenas_are_exactly_the_weight_bytes(layers, experts, hidden, intermediate):
    torch.cuda.init()
    before = host_allocator_bytes()
    store = ExpertStore(layers, experts, hidden, intermediate, torch.bfloat16, pin=True)
    weight_bytes = layers * experts * 3 * hidden * intermediate * 2
    assert store.weight_bytes == weight_bytes and store.pinned_bytes == weight_bytes and store.is_pinned
    assert all(a.is_pinned() for a in store.arenas)  # page-locked in place (cudaHostRegister)
    if before is not None:  # nothing went through torch's power-of-two pinned allocator
        assert host_allocator_bytes() - before < weight_bytes
    if hidden == 2048:
        assert store.expert_bytes == 9_437_184
    arena = store.arenas[0]
    store.release()
    assert not arena.is_pinned()  # unregistered on release


def test_a_failed_pin_warns_and_leaves_cuda_usable():
    """A failed cudaHostRegister sets the CUDA runtime's last error; unless it is consumed, the next error-checked
    call (an unrelated kernel launch) raises it. The store must warn and leave CUDA usable."""
    store = ExpertStore(1, 2, 64, 32, torch.float32, pin=True)
    with pytest.warns(RuntimeWarning, match="pinning the expert arenas failed"):
        store._pin()  # already registered: cudaErrorHostMemoryAlreadyRegistered
    x = torch.ones(4, device="cuda") * 2
    torch.cuda.synchronize()
    assert x.sum().item() == 8
    store.release()


def test_enable_pins_the_experts_of_a_cuda_model():
    model = cuda_model()
    specfit.enable(model, cache_slots=3)
    rt = model.specfit
    assert rt.device.type == "cuda" and rt.layers[0].cache.slots.is_cuda
    assert rt.store.is_pinned and rt.store.pinned_bytes == rt.store.weight_bytes == 4 * E * 3 * 32 * 64 * 4
    assert all(not a.is_cuda for a in rt.store.arenas)


# --- the slot cache on the device ---------------------------------------------------------------------------------
def router_gap(model, ids):
    with torch.no_grad():
        router = model(ids, output_router_logits=True).router_logits
    top = torch.stack([torch.softmax(r.float(), -1).topk(K + 1, dim=-1).values for r in router])
    return float((top[..., K - 1] - top[..., K]).min())


@pytest.mark.parametrize("slots", [1, 3, K, E])
def test_logits_equal_reference_at_every_slot_count(slots):
    cpu_model = tiny_moe()
    ids = next(ids for ids in (torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(slots + 100 * s))
                               for s in range(200)) if router_gap(cpu_model, ids) > 1e-4)  # no router near-tie
    with torch.no_grad():
        cpu_ref = cpu_model(ids).logits
    model = cuda_model()
    cuda_ref = cuda_logits(model, ids)
    specfit.enable(model, cache_slots=slots, cold="copy")  # the copy path (the lane: the test below)
    for _ in range(2):  # cold, then warm slots
        out = cuda_logits(model, ids)
        torch.testing.assert_close(out, cuda_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.cpu(), cpu_ref, rtol=1e-4, atol=1e-4)
    c = model.specfit.stats.last_forward
    if slots < E:  # 40 tokens x top-4 need more distinct experts per layer than there are slots: some stream
        assert c.streamed > 0 and c.misses > 0
    else:
        assert c.misses == 0 and c.hits == c.demand


def test_decode_steps_match_with_small_cache():
    """One token at a time (the decode regime) through 2 slots, against the unpatched model on the GPU."""
    ids = clear_prompt(12, 16).cuda()
    reference = cuda_model()
    expected = reference.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    model = specfit.enable(cuda_model(), cache_slots=2, cold="copy")
    assert torch.equal(model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False), expected)
    g = model.specfit.stats.last_generate
    assert g.new_tokens == 16 and g.misses > 0 and g.bytes_copied == g.misses * model.specfit.store.expert_bytes


# --- the copy stream ----------------------------------------------------------------------------------------------
def test_copy_runs_on_the_copy_stream_while_compute_is_busy():
    device = torch.device("cuda")
    engine = CopyEngine(device)
    assert engine.demand_stream != torch.cuda.current_stream(device) != engine.prefetch_stream
    assert engine.demand_stream != engine.prefetch_stream
    store = ExpertStore(1, 4, 2048, 768, torch.bfloat16, pin=True)  # 4 real-size experts, pinned
    store.arenas[0].normal_()
    dst = torch.empty(store.expert_numel, dtype=torch.bfloat16, device=device)
    counters = Counters()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # compute queued on the compute stream
    ticket, = engine.copy_batch([(dst, store.arenas[0][2])], counters)
    ticket.synchronize()  # the copy has landed ...
    busy = not torch.cuda.current_stream(device).query()  # ... while the compute stream still runs
    engine.wait(ticket, counters)
    torch.cuda.synchronize()
    assert busy, "the expert copy waited for the compute stream: it is not on a separate stream"
    assert torch.equal(dst.cpu(), store.arenas[0][2]) and counters.bytes_copied == 9_437_184
    store.release()


def test_overwrite_waits_for_queued_compute():
    """A slot about to be overwritten may still be read by queued compute: before_overwrite orders the copy after it,
    and a scratch copy waits for the event it is given."""
    device = torch.device("cuda")
    engine = CopyEngine(device)
    store = ExpertStore(1, 2, 256, 128, torch.float32, pin=True)
    store.arenas[0].normal_()
    dst = torch.empty(store.expert_numel, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    engine.before_overwrite()
    ticket, = engine.copy_batch([(dst, store.arenas[0][0])], Counters())
    assert not ticket.query()  # still waiting for the compute queued before it
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    done = engine.mark_compute()
    ticket, = engine.copy_batch([(dst, store.arenas[0][1])], Counters(), after=(done,))
    assert not ticket.query()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), store.arenas[0][1])
    store.release()


def test_forward_copies_every_miss_on_the_copy_stream_from_pinned_memory(monkeypatch):
    model = specfit.enable(cuda_model(), cache_slots=3, cold="copy")
    rt = model.specfit
    seen = []
    original = torch.Tensor.copy_

    def spy(self, src, non_blocking=False):
        if self.is_cuda and src.device.type == "cpu" and src.numel() == rt.store.expert_numel:
            seen.append((torch.cuda.current_stream().cuda_stream, src.is_pinned(), non_blocking))
        return original(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    cuda_logits(model, ids)  # 40 tokens through 3 slots: loads and streamed experts
    cuda_logits(model, ids[:, :1])
    monkeypatch.undo()
    c = rt.stats.total
    assert c.streamed > 0 and len(seen) == c.misses > 0
    assert {s for s, _, _ in seen} == {rt.engine.demand_stream.cuda_stream}
    assert all(pinned and non_blocking for _, pinned, non_blocking in seen)
    assert c.copy_busy_seconds > 0 and c.pageable_copies == 0  # timed by the forwards themselves, no sync here


def test_one_host_sync_per_moe_layer(monkeypatch):
    """The routes' transfer to the host is the only sync of the experts function (a CUDA bincount would add two)."""
    model = specfit.enable(cuda_model(), cache_slots=3, cold="copy")
    original, syncs = LayerRuntime.forward, []

    def counted(self, *args):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = original(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        return out

    monkeypatch.setattr(LayerRuntime, "forward", counted)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    gc.collect()  # a finalizer run by the collector mid-forward (an old model's streams) would sync inside a layer
    gc.disable()
    try:
        cuda_logits(model, ids)  # loads and streamed experts
        cuda_logits(model, ids[:, :1])
    finally:
        gc.enable()
    assert syncs == [1] * (2 * len(model.specfit.layers))


def test_demand_misses_do_not_wait_for_queued_prefetches():
    """Prefetches for every layer are queued behind a stalled prefetch stream; a forward whose experts are all
    misses (none of them prefetched) must still complete."""
    model = specfit.enable(cuda_model(), cache_slots=8, cold="copy")
    rt = model.specfit
    ids = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(3))
    expected = cuda_logits(model, ids)
    needed = rt.routes.last[0].numpy()  # [layers, E] this token's experts
    rt.clear_cache()
    unneeded = ~needed & (np.cumsum(~needed, axis=1) <= 4)  # 4 other experts per layer
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
    blocker = torch.cuda.Event()
    blocker.record(side)
    rt.engine.prefetch_stream.wait_event(blocker)  # the prefetch stream is stalled for ~0.5 s
    rt.prefetch(unneeded)
    out = cuda_logits(model, ids)
    torch.cuda.current_stream().synchronize()  # the forward is done ...
    stalled = not rt.engine.prefetch_stream.query()  # ... while the prefetches are still queued
    torch.cuda.synchronize()
    assert stalled, "the forward finished only after the stalled prefetch stream: its demand copies waited for it"
    assert rt.stats.last_forward.misses == int(needed.sum())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_copy_time_is_counted_in_the_forward_that_made_the_copies():
    model = specfit.enable(cuda_model(), cache_slots=E, cold="copy")
    rt = model.specfit
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        model(ids)  # cold: every expert is a miss
    c = rt.stats.last_forward
    assert c.misses > 0 and c.copy_busy_seconds > 0 and c.bytes_copied == c.misses * rt.store.expert_bytes
    assert not rt.engine._timings  # nothing left to count later
    first = rt.stats.total.copy_busy_seconds
    with torch.no_grad():
        model(ids)  # warm: all hits
    assert rt.stats.last_forward.misses == 0 and rt.stats.last_forward.copy_busy_seconds == 0
    assert rt.stats.total.copy_busy_seconds == first


def test_pageable_arenas_are_counted_on_every_copy():
    model = specfit.enable(cuda_model(), cache_slots=3, pin=False, cold="copy")
    cuda_logits(model, torch.randint(0, 256, (1, 6)))
    c = model.specfit.stats.last_forward
    assert not model.specfit.store.is_pinned and c.pageable_copies == c.misses > 0


# --- teardown -----------------------------------------------------------------------------------------------------
def queued_prefetch(store, slots=4):
    """A layer cache whose prefetch copies are queued behind ~0.5 s of compute (they wait for it to overwrite)."""
    engine = CopyEngine(torch.device("cuda"))
    cache = LayerCache(store, 0, slots, engine)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    cache.prefetch(list(range(slots)), Counters())
    assert not engine.prefetch_stream.query()
    return cache, engine


def test_slots_freed_mid_copy_are_not_reused_before_the_copy_lands():
    store = ExpertStore(1, 8, 256, 128, torch.float32, pin=True)
    cache, engine = queued_prefetch(store)
    ptr, shape = cache.slots.data_ptr(), tuple(cache.slots.shape)
    del cache
    gc.collect()  # the slots are freed while copies into them are queued
    fresh = torch.empty(shape, device="cuda")  # same size, same stream: the freed block, were it not held
    reused = fresh.data_ptr() == ptr
    torch.cuda.synchronize()
    assert not reused, "the freed slots' memory was handed out while a copy into it was still queued"
    store.release()


def test_release_waits_for_copies_still_reading_the_arenas():
    store = ExpertStore(1, 8, 256, 128, torch.float32, pin=True)
    store.arenas[0].normal_()
    expected = store.arenas[0][:4].clone()
    cache, engine = queued_prefetch(store)
    store.release()  # unpins the arenas: only after the queued copies have read them
    assert engine.prefetch_stream.query()
    assert torch.equal(cache.slots.cpu(), expected)


# --- tree decoding ------------------------------------------------------------------------------------------------
def random_drafter(seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    return Eagle3Drafter(Eagle3Config.from_target(tiny_moe_config(), draft_vocab_size=128))


@pytest.mark.parametrize("walk", ["one transfer", "processors"])
@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_greedy_tree_decoding_equals_plain_generate(assistant, walk):
    """Both greedy acceptance paths: raw logits (no eos, no processor: every position's argmax in one transfer) and
    with a logits processor (``min_new_tokens``: the walk scores node by node)."""
    reference = cuda_model()
    model = specfit.enable(cuda_model(), cache_slots=4, drafter=random_drafter(), cost_model=FREE_NODES)
    kw = dict(max_new_tokens=20, do_sample=False)
    if walk == "processors":
        kw["min_new_tokens"] = 20
    else:
        reference.generation_config.eos_token_id = model.generation_config.eos_token_id = None
    assert next(model.specfit.drafter.parameters()).is_cuda
    prompts = [clear_prompt(n, 20).cuda() for n in (5, 21)]
    shapes = [dict(topk=2, depth=5, pool_nodes=18, max_nodes=7), dict(topk=3, depth=3, pool_nodes=12, max_nodes=5)]
    for prompt, shape in itertools.product(prompts, shapes):
        configure(model, **shape)
        expected = reference.generate(prompt, **kw)
        out = model.generate(prompt, assistant=assistant, **kw)
        assert torch.equal(out, expected), f"prompt of {prompt.shape[1]}, tree {shape}"
        g = model.specfit.stats.last_generate
        assert g.new_tokens == 20 and g.cycles > 0 and 0 < g.nodes_per_cycle <= shape["max_nodes"]
    assert torch.equal(model.generate(prompts[0], **kw), reference.generate(prompts[0], **kw))


def test_bf16_experts_run_grouped_over_the_slots_and_match_the_gathered_path():
    """In bf16 on CUDA the experts run as grouped matmuls over all slots (no per-layer copy of gathered weights);
    one layer's experts forward gives what the gathered path gives (bf16 rounding), hits, loads and streamed alike."""
    model = specfit.enable(tiny_moe().to(torch.bfloat16).cuda(), cache_slots=3)
    rt = model.specfit
    assert rt.grouped_experts, "grouped_mm over the slot view was refused on this GPU"
    layer = rt.layers[0]
    experts = seam_moe_experts(model)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(24, 64, generator=g, device="cuda").to(torch.bfloat16)
    index = torch.stack([torch.randperm(E, generator=g, device="cuda")[:K] for _ in range(24)])  # [24, K]
    weights = torch.softmax(torch.randn(24, K, generator=g, device="cuda"), -1).to(torch.bfloat16)
    outs = []
    for grouped in (True, False):
        rt.grouped_experts = grouped
        rt.clear_cache()
        rt.begin_forward()
        outs.append(layer.forward(experts, hidden, index, weights).float())
        rt.end_forward()
        assert rt.stats.last_forward.streamed > 0
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


def seam_moe_experts(model):
    from specfit.seam import layers as hf_layers

    return hf_layers.moe_layers(model)[0].experts


# --- FP8 experts ---------------------------------------------------------------------------------------------------
def test_fp8_checkpoint_runs_on_any_compute_capability(tmp_path):
    """Issue 39, 4: a block-wise FP8 checkpoint loads on this GPU whatever its compute capability (>= 8.9 too, where
    transformers would run its FP8 kernels): the arenas and slots hold e4m3 bytes and scales, the experts are
    dequantized on the device (bit for bit transformers' formula), the logits are the CPU's (the same dequantized
    model, which tests/test_fp8.py holds against transformers' own load), and greedy decoding with either assistant
    equals the model's plain generate()."""
    from test_fp8 import write_fp8

    from specfit.offload.formats import dequantize, quantize

    write_fp8(tmp_path)
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 3
    q, s = quantize(w, (16, 32))
    for dtype in (torch.bfloat16, torch.float32):
        want = (q.float().reshape(4, 16, 3, 32) * s[:, None, :, None]).to(dtype).reshape(64, 96)
        assert torch.equal(dequantize(q.cuda(), s.cuda(), dtype).cpu(), want)
    cpu = specfit.from_pretrained(tmp_path, cache_slots=4, dtype=torch.float32, device="cpu")
    model = specfit.from_pretrained(tmp_path, cache_slots=4, dtype=torch.float32, device="cuda",
                                    drafter=random_drafter(), cost_model=FREE_NODES)
    rt = model.specfit
    assert rt.store.format.name == "fp8" and rt.store.dtype == torch.uint8 and rt.store.is_pinned
    assert rt.store.expert_bytes == cpu.specfit.store.expert_bytes < 3 * 32 * 64 * 2  # below bf16's
    ids = torch.randint(2, 256, (1, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids.cuda()).logits.cpu(), cpu(ids).logits, rtol=1e-4, atol=1e-4)
    model.generation_config.eos_token_id = None
    kw = dict(max_new_tokens=12, do_sample=False)
    expected = model.generate(ids.cuda(), **kw)
    assert rt.stats.last_generate.misses > 0  # through the slot cache: FP8 rows copied, dequantized on the device
    for assistant in ("eagle3", "specfit"):
        assert torch.equal(model.generate(ids.cuda(), assistant=assistant, **kw), expected), assistant


# --- the loader ---------------------------------------------------------------------------------------------------
def test_loader_streams_a_sharded_checkpoint_onto_cuda(tmp_path):
    tiny_moe(seed=4).save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 5
    ids = clear_prompt(11, 8, seed=4).cuda()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").cuda().eval()
    model = specfit.from_pretrained(tmp_path, cache_slots=3, dtype=torch.float32, device="cuda")
    rt = model.specfit
    assert rt.device.type == "cuda"
    assert all(p.is_cuda for p in model.parameters()) and all(b.is_cuda for b in model.buffers())
    assert not any("experts" in n for n, _ in model.named_parameters())
    assert rt.store.is_pinned and rt.store.pinned_bytes == rt.store.weight_bytes
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False),
                       reference.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False))
    bf16 = specfit.from_pretrained(tmp_path, cache_slots=3, dtype=torch.bfloat16, device="cuda")
    assert bf16.specfit.store.dtype == torch.bfloat16 and bf16.specfit.store.is_pinned
    assert bf16.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape == (1, 15)
