"""Routing statistics that matter to SpecFit, measured on held-out text.

Vocabulary: a *route* is the set of the K experts a token uses in one layer (the top-K of that layer's router
logits). E experts per layer, L MoE layers. *Shuffled* keeps every token's real route but permutes the token order:
it separates the effect of context (adjacent tokens, sibling candidates) from that of uneven expert popularity.
*Uniform* is independent uniform top-K routing, whose union over k tokens is ``E * (1 - (1 - K/E)**k)``.
*Siblings* are the top next-token candidates after the same prefix, each appended at the same position.

The statistics are pure NumPy over a bool expert mask ``[L, B, T, E]``; only ``collect_*`` touch the model.
Run ``python -m specfit.training.routing_stats MODEL_DIR`` to print the tables for a saved model.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# --------------------------------------------------------------------------------------------- pure statistics


def expert_mask(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """``[..., K]`` expert ids -> ``[..., E]`` bool mask."""
    mask = np.zeros(routes.shape[:-1] + (num_experts,), dtype=bool)
    np.put_along_axis(mask, routes, True, axis=-1)
    return mask


def uniform_union(num_experts: int, top_k: int, k: int) -> float:
    """Expected union of k independent uniform top-K routes: ``E (1 - (1 - K/E)^k)``."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** k)


def load_balance(mask: np.ndarray) -> dict:
    """Per-layer usage entropy / ln E, effective experts e^H, max load / mean load and dead experts.

    ``mask``: ``[L, B, T, E]`` bool. Example: 4 experts used equally -> entropy ratio 1.0, effective 4, max/mean 1.
    """
    counts = mask.reshape(mask.shape[0], -1, mask.shape[-1]).sum(1).astype(np.float64)  # [L, E]
    p = counts / counts.sum(-1, keepdims=True)
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1)
    return {
        "entropy_ratio": (entropy / math.log(mask.shape[-1])).tolist(),
        "effective_experts": np.exp(entropy).tolist(),
        "max_over_mean_load": (counts.max(-1) / counts.mean(-1)).tolist(),
        "dead_experts": (counts == 0).sum(-1).astype(int).tolist(),
    }


def adjacent_reuse(mask: np.ndarray) -> dict:
    """Per layer: P(an expert of token t is also used by t+1), and P(t and t+1 share at least one expert)."""
    shared = (mask[:, :, :-1] & mask[:, :, 1:]).sum(-1)  # [L, B, T-1]
    top_k = mask[0, 0, 0].sum()
    return {"reuse": (shared.mean((1, 2)) / top_k).tolist(), "share_any": (shared > 0).mean((1, 2)).tolist()}


def union_curve(mask: np.ndarray, max_k: int = 8) -> np.ndarray:
    """Mean per-layer union of experts over k = 1..max_k consecutive tokens (windows inside each sequence).

    Returns ``[L, max_k]``. For routes that never change along a sequence every entry is K.
    """
    acc = mask
    out = [acc.sum(-1).mean((1, 2))]
    for k in range(2, max_k + 1):
        acc = acc[:, :, :-1] | mask[:, :, k - 1:]  # acc[t] = OR of mask[t .. t+k-1]
        out.append(acc.sum(-1).mean((1, 2)))
    return np.stack(out, axis=1)


def shuffle_tokens(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The same routes with the token order permuted across the whole sample (one permutation for all layers)."""
    L, B, T, E = mask.shape
    flat = mask.reshape(L, B * T, E)
    return flat[:, rng.permutation(B * T)].reshape(L, B, T, E)


def union_of(masks: np.ndarray) -> np.ndarray:
    """``[L, P, m, E]`` -> mean union size over the m routes, per layer ``[L]``."""
    return masks.any(2).sum(-1).mean(1)


def sibling_stats(cand: np.ndarray, rand: np.ndarray, rng: np.random.Generator) -> dict:
    """Per-layer unions for tokens at the same position after the same prefix.

    Args:
        cand: ``[L, P, C, E]`` routes of the top-C next-token candidates (best first) at P positions.
        rand: ``[L, P, 2, E]`` routes of two random corpus tokens appended to the same prefixes.
    Returns per layer: ``top{m}`` (union of the top-m candidates, m = 2..C), ``random_same_prefix`` and
    ``unrelated`` (top-1 tokens of two different positions).
    """
    out = {f"top{m}": union_of(cand[:, :, :m]).tolist() for m in range(2, cand.shape[2] + 1)}
    out["random_same_prefix"] = union_of(rand).tolist()
    P = cand.shape[1]
    other = (np.arange(P) + rng.integers(1, P)) % P if P > 1 else np.arange(P)
    out["unrelated"] = union_of(np.stack([cand[:, :, 0], cand[:, other, 0]], axis=2)).tolist()
    return out


# --------------------------------------------------------------------------------------------- model boundary


def _routes(router_logits, top_k: int, shape) -> np.ndarray:
    """Tuple of L ``[B*T, E]`` logits -> ``[L, B, T, K]`` expert ids (top-K of the logits = top-K of softmax)."""
    return np.stack([lg.float().topk(top_k, dim=-1).indices.reshape(*shape, top_k).numpy() for lg in router_logits])


@torch.no_grad()
def collect_routes(model, windows: torch.Tensor, batch_size: int = 8, num_candidates: int = 4):
    """Forward windows and return (routes ``[L, B, T, K]``, top-C next-token candidates ``[B, T, C]``)."""
    K = model.config.num_experts_per_tok
    routes, cands = [], []
    for i in range(0, len(windows), batch_size):
        x = windows[i: i + batch_size]
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        routes.append(_routes(out.router_logits, K, x.shape))
        cands.append(out.logits.topk(num_candidates, dim=-1).indices.numpy())
    return np.concatenate(routes, axis=1), np.concatenate(cands)


@torch.no_grad()
def collect_appended_routes(model, window: torch.Tensor, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Routes of extra tokens appended after prefixes of one window, all in one forward with a 4-D mask.

    Token ``tokens[i, j]`` is placed at position ``positions[i] + 1`` and sees only ``window[:positions[i] + 1]``
    and itself, which equals a plain forward of that prefix plus the token.
    Args: window ``[T]``; positions ``[P]``; tokens ``[P, C]``. Returns ``[L, P, C, K]``.
    """
    T, (P, C) = len(window), tokens.shape
    dtype = model.dtype
    ids = torch.cat([window, torch.as_tensor(tokens.reshape(-1), dtype=window.dtype)])
    S = len(ids)
    ok = torch.zeros(S, S, dtype=torch.bool)
    ok[:T, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    pos = torch.cat([torch.arange(T), torch.as_tensor(np.repeat(positions + 1, C))])
    for r in range(P * C):
        ok[T + r, : positions[r // C] + 1] = True
        ok[T + r, T + r] = True
    mask = torch.zeros(S, S, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)[None, None]
    # Routes come from hooks on the routers: output_router_logits would also compute the aux loss, which
    # expects a 2-D attention mask.
    indices = []
    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda mod, inp, out: indices.append(out[2])) for g in gates]
    try:
        model(input_ids=ids[None], attention_mask=mask, position_ids=pos[None], output_router_logits=False,
              use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return np.stack([idx[T:].reshape(P, C, -1).numpy() for idx in indices])


def routing_stats(model, windows: torch.Tensor, max_k: int = 8, sibling_positions: int = 192,
                  num_candidates: int = 4, seed: int = 0) -> dict:
    """All statistics on ``windows`` ``[B, T]`` of held-out text; a dict of plain lists (JSON-ready).

    ``sibling_positions`` prefixes (spread over the windows, each at least 8 tokens long) get their top-C
    candidates and two random tokens of the same text appended.
    """
    model.eval()
    rng = np.random.default_rng(seed)
    E, K = model.config.num_experts, model.config.num_experts_per_tok
    routes, cands = collect_routes(model, windows, num_candidates=num_candidates)
    mask = expert_mask(routes, E)  # [L, B, T, E]
    shuffled = shuffle_tokens(mask, rng)
    stats = {"num_tokens": int(windows.numel()), "windows": list(windows.shape), "num_experts": E, "top_k": K,
             "num_layers": int(mask.shape[0]), **load_balance(mask)}
    reuse, reuse_shuffled = adjacent_reuse(mask), adjacent_reuse(shuffled)
    stats.update(reuse=reuse["reuse"], reuse_shuffled=reuse_shuffled["reuse"], share_any=reuse["share_any"],
                 reuse_uniform=K / E)
    curve, curve_shuffled = union_curve(mask, max_k), union_curve(shuffled, max_k)
    stats["union"] = {"k": list(range(1, max_k + 1)), "per_layer": curve.tolist(), "mean": curve.mean(0).tolist(),
                      "shuffled_mean": curve_shuffled.mean(0).tolist(),
                      "uniform": [uniform_union(E, K, k) for k in range(1, max_k + 1)]}
    if sibling_positions:
        B, T = windows.shape
        per_window = max(1, -(-sibling_positions // B))
        pool = windows.reshape(-1).numpy()
        cand_routes, rand_routes = [], []
        for b in range(B):
            if b * per_window >= sibling_positions:
                break
            pos = np.sort(rng.choice(np.arange(8, T - 1), size=min(per_window, T - 9), replace=False))
            rand = pool[rng.integers(0, len(pool), size=(len(pos), 2))]
            appended = collect_appended_routes(model, windows[b], pos, np.concatenate([cands[b, pos], rand], 1))
            cand_routes.append(appended[:, :, :num_candidates])
            rand_routes.append(appended[:, :, num_candidates:])
        sib = sibling_stats(expert_mask(np.concatenate(cand_routes, 1), E),
                            expert_mask(np.concatenate(rand_routes, 1), E), rng)
        stats["siblings"] = {"positions": int(sum(c.shape[1] for c in cand_routes)), "per_layer": sib,
                             "mean": {name: float(np.mean(v)) for name, v in sib.items()},
                             "uniform": {f"top{m}": uniform_union(E, K, m) for m in range(2, num_candidates + 1)}}
    return stats


# --------------------------------------------------------------------------------------------- tables


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def format_tables(stats: dict) -> str:
    """Markdown tables of a ``routing_stats`` dict (load balance and reuse; unions over k; siblings)."""
    L, E, K = stats["num_layers"], stats["num_experts"], stats["top_k"]
    lines = [f"Routing on {stats['num_tokens']} held-out tokens ({E} experts, top-{K}, {L} layers).", "",
             _row(["layer", "entropy / ln E", "effective experts", "max / mean load", "dead experts",
                   "P(reuse t→t+1)", "shuffled", f"uniform K/E", "P(share ≥1)"]), _row(["---"] * 9)]
    cols = ["entropy_ratio", "effective_experts", "max_over_mean_load", "dead_experts", "reuse", "reuse_shuffled"]
    for layer in range(L):
        cells = [f"{stats[c][layer]:.3f}" if c in ("entropy_ratio", "reuse", "reuse_shuffled")
                 else f"{stats[c][layer]:.1f}" if c != "dead_experts" else str(stats[c][layer]) for c in cols]
        lines.append(_row([str(layer)] + cells + [f"{stats['reuse_uniform']:.3f}", f"{stats['share_any'][layer]:.2f}"]))
    mean = [f"{np.mean(stats['entropy_ratio']):.3f}", f"{np.mean(stats['effective_experts']):.1f}",
            f"{np.mean(stats['max_over_mean_load']):.1f}", f"{sum(stats['dead_experts'])} of {L * E}",
            f"{np.mean(stats['reuse']):.3f}", f"{np.mean(stats['reuse_shuffled']):.3f}",
            f"{stats['reuse_uniform']:.3f}", f"{np.mean(stats['share_any']):.2f}"]
    lines += [_row(["**mean**"] + mean), ""]
    u = stats["union"]
    lines += ["Mean per-layer union of experts over k consecutive tokens:", "",
              _row([""] + [f"k={k}" for k in u["k"]]), _row(["---"] * (len(u["k"]) + 1))]
    lines += [_row([f"L{i}"] + [f"{v:.2f}" for v in row]) for i, row in enumerate(u["per_layer"])]
    lines += [_row(["**mean, consecutive**"] + [f"{v:.2f}" for v in u["mean"]]),
              _row(["mean, shuffled order"] + [f"{v:.2f}" for v in u["shuffled_mean"]]),
              _row(["uniform E(1-(1-K/E)^k)"] + [f"{v:.2f}" for v in u["uniform"]]),
              _row(["consecutive / uniform"] + [f"{a / b:.2f}" for a, b in zip(u["mean"], u["uniform"])]), ""]
    if "siblings" in stats:
        s = stats["siblings"]
        names = list(s["per_layer"])
        lines += [f"Union of experts per layer for tokens at the same position ({s['positions']} positions):", "",
                  _row(["layer"] + names), _row(["---"] * (len(names) + 1))]
        lines += [_row([str(i)] + [f"{s['per_layer'][n][i]:.2f}" for n in names]) for i in range(L)]
        lines += [_row(["**mean**"] + [f"{s['mean'][n]:.2f}" for n in names]),
                  _row(["uniform"] + [f"{s['uniform'].get(n, s['uniform']['top2']):.2f}" for n in names]), ""]
    return "\n".join(lines)


def summary(stats: dict) -> str:
    """Two sentences for a model card."""
    u, parts = stats["union"], []
    parts.append(f"{np.mean(stats['effective_experts']):.1f} effective experts of {stats['num_experts']} per layer "
                 f"(entropy ratio {np.mean(stats['entropy_ratio']):.2f}), {sum(stats['dead_experts'])} of "
                 f"{stats['num_layers'] * stats['num_experts']} layer-experts unused on this text; an expert of token t "
                 f"is reused by t+1 with probability {np.mean(stats['reuse']):.3f} "
                 f"(shuffled order {np.mean(stats['reuse_shuffled']):.3f}, uniform {stats['reuse_uniform']:.3f}).")
    parts.append(f"Union over {u['k'][-1]} consecutive tokens: {u['mean'][-1]:.1f} experts per layer, against "
                 f"{u['shuffled_mean'][-1]:.1f} in shuffled order and {u['uniform'][-1]:.1f} for uniform routing.")
    if "siblings" in stats:
        m = stats["siblings"]["mean"]
        parts.append(f"The top-2 next-token candidates at one position use {m['top2']:.2f} experts per layer together "
                     f"(two random tokens after the same prefix: {m['random_same_prefix']:.2f}; unrelated tokens: "
                     f"{m['unrelated']:.2f}; uniform: {stats['siblings']['uniform']['top2']:.2f}).")
    return " ".join(parts)


def gsm8k_test_windows(tokenizer, num_windows: int = 64, seq_len: int = 256) -> torch.Tensor:
    """Consecutive windows of GSM8K *test* text in the training format (statistics only, never training)."""
    from ..evaluation.datasets import gsm8k
    from .corpus import encode_stream, fixed_windows, gsm8k_document

    stream = encode_stream(tokenizer, [gsm8k_document(r) for r in gsm8k("test")])
    return torch.from_numpy(fixed_windows(stream, seq_len - 1, num_windows))


def main(argv=None) -> int:
    import argparse

    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description="print the routing statistics of a saved Qwen3-MoE")
    parser.add_argument("model", help="folder with the model and its tokenizer")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    windows = gsm8k_test_windows(AutoTokenizer.from_pretrained(args.model), args.windows, args.seq_len)
    stats = routing_stats(model, windows)
    print(format_tables(stats))
    print(summary(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
