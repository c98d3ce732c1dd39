"""SpecFit's decoding loop: tree speculative decoding with a named assistant, inside ``model.generate()``.

One cycle: (1) draft a pool, (2) select the subtree to verify, (3) verify root + subtree in one target forward,
(4) accept the longest agreeing path plus the bonus token, and show the assistant what the target did with the
drafted children of the positions it scored (its acceptance model learns from them; no extra transfer for greedy
decoding, one per cycle for sampling), (5) compact the KV cache to that path, (6) observe:
commit the tokens (stopping criteria, streamer) and feed the drafter. The target runs every expert its router picks,
so the output equals plain ``generate()`` (greedy: token for token; sampling: in distribution).
"""

from __future__ import annotations

import time

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .. import seam
from ..drafting.tree import verify_layout
from ..selection.route_sources import Cycle
from .acceptance import walk, walk_greedy

UNSUPPORTED = {"num_beams": 1, "num_return_sequences": 1, "output_attentions": False, "output_hidden_states": False}


def check_generate_arguments(model, args, kwargs) -> None:
    """Refuse, before any work, what assistant decoding cannot do."""
    if getattr(model, "specfit", None) is None:
        raise RuntimeError("assistant=... needs SpecFit: call specfit.enable(model, cache_slots=..., drafter=...)")
    if model.specfit.drafter is None:
        raise ValueError("assistant=... needs a drafter: specfit.enable(model, ..., drafter=PATH_OR_MODULE)")
    if kwargs.get("assistant_model") is not None:
        raise ValueError("pass either assistant= (SpecFit tree decoding) or assistant_model= (transformers), not both")
    config = kwargs.get("generation_config") or model.generation_config
    for name, allowed in UNSUPPORTED.items():
        value = kwargs.get(name, getattr(config, name, None))
        if value not in (None, allowed):
            raise ValueError(f"assistant decoding does not support {name}={value!r} (only {allowed!r})")
    if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
        raise ValueError("assistant decoding verifies trees against the KV cache: use_cache=False is not supported")
    for name in ("inputs_embeds", "prefill_chunk_size"):
        if kwargs.get(name, getattr(config, name, None)) is not None:
            raise ValueError(f"assistant decoding does not support {name}= (pass input_ids; prefill in one piece)")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None:
        seam.check_cache(cache)
    seam.check_attention(model)


@torch.no_grad()
def decode(model, assistant, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
           **model_kwargs):
    runtime = model.specfit
    if input_ids.shape[0] != 1:
        raise ValueError(f"assistant decoding runs one sequence at a time (batch size 1), got a batch of "
                         f"{input_ids.shape[0]}; loop over the prompts, or use generate() without assistant= for "
                         f"batches")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("assistant decoding takes an unpadded prompt (attention_mask has zeros)")
    cache = model_kwargs["cache"]
    seam.check_cache(cache)
    cache = seam.ensure_room(model, cache, generation_config.max_length + runtime.options.pool_nodes + 1)
    do_sample = bool(generation_config.do_sample)
    gen = assistant(model)
    run = _Run(input_ids, logits_processor, stopping_criteria, generation_config, streamer)
    scope = runtime.stats.begin_generate()

    # 0. prefill: the prompt's KV and features; its last logits give the first token (the first root)
    out = model(input_ids, cache=cache, position_ids=model_kwargs.get("position_ids"), use_cache=True,
                logits_to_keep=1)
    features = runtime.aux_capture.features()  # [1, P, 3H]
    scope.prefill_done()  # from here on, everything is decode time: the first token, the drafter's prompt pass
    first = walk(lambda t: [], [], lambda t, acc: run.scores(out.logits[0, -1], acc), do_sample)
    run.commit(first)
    if not run.done:
        gen.start(features, torch.cat([input_ids[:, 1:], run.ids[:, -1:]], dim=1))

    while not run.done:
        t0 = time.perf_counter()
        cycle = Cycle(model, cache, base=seam.kv_length(cache), root=int(run.ids[0, -1]), sampling=do_sample)
        tree = gen.draft(cycle)  # 1. draft
        nodes = gen.select(tree, cycle)  # 2. select
        t_drafted = time.perf_counter()
        layout = verify_layout(tree, nodes, cycle.root, cycle.base, seam.kv_capacity(cache, len(nodes) + 1),
                               seam.compute_dtype(model), runtime.device)
        masks = None if layout.mask is None else \
            seam.layer_masks(model, cache, layout.mask, layout.position_ids)  # per layer type (sliding windows)
        out = model(layout.tokens, cache=cache, position_ids=layout.position_ids, attention_mask=masks,
                    use_cache=True, logits_to_keep=0)  # 3. verify
        verify = runtime.stats.last_forward
        tokens = [cycle.root] + [tree.tokens[v] for v in layout.nodes]  # the host has them: no device round trip
        choices = None
        if run.plain_greedy:  # 4. accept (one transfer of every position's argmax when scores are raw logits)
            choices = out.logits[0].argmax(-1).tolist()
            acc = walk_greedy(layout.children, tokens, choices, lambda t: out.logits[0, t].float())
        else:
            acc = walk(layout.children, tokens, lambda t, accepted: run.scores(out.logits[0, t], accepted),
                       do_sample)
        gen.learn(tree, layout, acc, choices, do_sample)  # what the target did with the drafted children it saw
        kept = [0] + acc.path  # tree indices, ascending
        if kept == list(range(len(kept))):  # 5. compact: the path is a prefix of the layout, so cropping suffices
            seam.crop_kv(cache, cycle.base + len(kept))
        else:
            seam.keep_kv(cache, cycle.base, torch.tensor(kept, device=runtime.device))
        committed = run.commit(acc)  # 6. observe
        if not run.done:
            features = runtime.aux_capture.features()  # [1, n+1, 3H]
            gen.observe(features if len(kept) == features.shape[1] else features[:, kept],
                        torch.tensor([acc.tokens], device=runtime.device))
        scope.cycle(pool=len(tree), verified=len(nodes), committed=committed, demand=verify.demand,
                    misses=verify.misses, seconds=time.perf_counter() - t0, measurement=cycle.measurement_seconds,
                    draft_seconds=t_drafted - t0, expected=gen.expected_tokens)

    seam.crop_kv(cache, run.ids.shape[1] - 1)  # tokens cut by the stopping criteria leave no KV behind
    scope.end(new_tokens=run.ids.shape[1] - input_ids.shape[1])
    if streamer is not None:
        streamer.end()
    return run.result(cache)


class _Run:
    """The sequence being generated: logits processing per tree node, committing tokens one by one against the
    stopping criteria (max length, eos, stop strings) exactly as plain decoding does, streaming, outputs."""

    def __init__(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer):
        self.ids, self.processors, self.stopping = input_ids, logits_processor, stopping_criteria
        self.config, self.streamer = generation_config, streamer
        # greedy with no logits processor and no raw logits kept: the scores are the logits themselves
        self.plain_greedy = not generation_config.do_sample and len(logits_processor) == 0 and \
            not generation_config.output_logits
        self.done = False
        self.all_scores, self.all_logits = [], []
        self._raw: list[torch.Tensor] = []  # raw logits behind each scores() call of this cycle, in walk order

    def scores(self, logits: torch.Tensor, accepted: list[int]) -> torch.Tensor:
        """Processed scores [V] for a node reached through ``accepted`` tokens after the committed ones."""
        prefix = self.ids if not accepted else torch.cat(
            [self.ids, torch.tensor([accepted], device=self.ids.device)], dim=1)
        raw = logits.float()[None]  # [1, V]
        if self.config.output_logits:  # kept only when asked for: processors may change their input in place
            self._raw.append(raw)
            raw = raw.clone()
        return self.processors(prefix, raw)[0]

    def commit(self, acc) -> int:
        """Append the accepted tokens and the bonus token, stopping where the stopping criteria say; returns how
        many were committed."""
        new = []
        raw, self._raw = self._raw, []
        for i, (token, scores) in enumerate(zip(acc.tokens, acc.scores)):
            self.ids = torch.cat([self.ids, torch.tensor([[token]], device=self.ids.device)], dim=1)
            self.all_scores.append(scores[None])
            if raw:
                self.all_logits.append(raw[i])
            new.append(token)
            if bool(self.stopping(self.ids, tuple(self.all_scores)).any()):
                self.done = True
                break
        if self.streamer is not None and new:
            self.streamer.put(torch.tensor([new]))
        return len(new)

    def result(self, cache):
        if not self.config.return_dict_in_generate:
            return self.ids
        return GenerateDecoderOnlyOutput(
            sequences=self.ids,
            scores=tuple(self.all_scores) if self.config.output_scores else None,
            logits=tuple(self.all_logits) if self.config.output_logits else None,
            cache=cache)
