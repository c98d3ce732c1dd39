"""Phase 5, compaction: ``seam.kv_cache.keep_kv`` on caches whose every written entry carries a code of its own, so
the kept keys and values are read back exactly (dynamic full and sliding-window layers, static layers)."""

import pytest
import torch
from conftest import tiny_moe_config
from transformers import DynamicCache, StaticCache

from specfit.seam import kv_cache

KV_HEADS, HEAD_DIM, WINDOW = 2, 16, 6
# cycles after a 9-token prefix: (codes the tree forward writes, tree indices accepted: the root, then a path)
CYCLES = [(list(range(100, 105)), [0, 2, 3]), (list(range(200, 206)), [0, 1, 5]), (list(range(300, 303)), [0])]


def write(cache, codes):
    """One forward's entries in every layer: keys ``code + layer / 10`` at each position, values minus the keys."""
    for layer in range(len(cache.layers)):
        keys = (torch.tensor(codes, dtype=torch.float32) + layer / 10)[None, None, :, None]
        keys = keys.expand(1, KV_HEADS, -1, HEAD_DIM).contiguous()  # [1, heads, n, D]
        cache.update(keys, -keys, layer)


def read(cache, layer, length):
    """The codes of the first ``length`` positions of a layer (checking values and every head/dim agree)."""
    keys, values = cache.layers[layer].keys[:, :, :length], cache.layers[layer].values[:, :, :length]
    assert torch.equal(values, -keys), f"layer {layer}: values were not compacted as the keys were"
    assert torch.equal(keys, keys[:, :1, :, :1].expand_as(keys)), f"layer {layer}: positions mixed"
    return [round(x - layer / 10) for x in keys[0, 0, :, 0].tolist()]


@pytest.mark.parametrize("kind", ["dynamic", "sliding", "static"])
def test_keep_kv_keeps_the_accepted_entries_in_order(kind):
    """After each tree forward, the cache holds exactly the committed entries, in order: the prefix, then per cycle
    the root and the accepted path (a sliding-window layer: the window's tail of them); the cache's length is the
    committed count. Kills the mutant: keep_kv keeps one index too many (one more entry, or a length one past)."""
    if kind == "static":
        config = tiny_moe_config(num_hidden_layers=2)
        cache = StaticCache(config=config, max_cache_len=32)
    else:
        sliding = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
                       use_sliding_window=True) if kind == "sliding" else {}
        cache = DynamicCache(config=tiny_moe_config(num_hidden_layers=2, **sliding))
        if kind == "sliding":
            cache.activate_past_recording()  # as kv_cache.ensure_room does: the tree forward evicts nothing
    committed = list(range(9))
    write(cache, committed)
    for written, keep in CYCLES:
        base = len(committed)
        write(cache, written)
        kv_cache.keep_kv(cache, base, torch.tensor(keep))
        committed += [written[t] for t in keep]
        assert kv_cache.kv_length(cache) == len(committed)
        for layer, cache_layer in enumerate(cache.layers):
            if kind == "sliding" and layer == 0:
                assert cache_layer.keys.shape[-2] == WINDOW - 1
                assert read(cache, layer, WINDOW - 1) == committed[-(WINDOW - 1):]
            else:
                if kind != "static":
                    assert cache_layer.keys.shape[-2] == len(committed)
                assert read(cache, layer, len(committed)) == committed
