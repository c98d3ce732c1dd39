"""SpecFit's decoding loop: tree speculative decoding with a named assistant, inside ``model.generate()``.

One cycle: (1) draft a pool, (2) select the subtree to verify, (3) verify root + subtree in one target forward,
(4) accept the longest agreeing path plus the bonus token, and show the assistant what the target did with the
drafted children of the positions it scored (its acceptance model learns from them; no extra transfer for greedy
decoding, one per cycle for sampling), (5) compact the KV cache to that path, (6) observe:
commit the tokens (stopping criteria, streamer) and feed the drafter. The target runs every expert its router picks,
so the output equals plain ``generate()``: greedy, token for token in fp32 (the prompt's forward is plain's bit for
bit; in bf16/fp16 a verify forward rounds differently from a one-token step, so texts may part at near-ties:
``evaluation/near_ties.py``); sampling, in distribution, each token drawn with Gumbel noise keyed by the call's seed
and its position, so the same seed gives the same text whatever the trees (``position_noise.py``).
"""

from __future__ import annotations

import inspect
import time

import torch
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from ..seam import generation, kv_cache, layers as hf_layers
from ..drafting.tree import verify_layout
from ..transfer import to_host
from ..selection.route_sources import Cycle
from .acceptance import walk, walk_greedy
from .position_noise import PositionNoise

UNSUPPORTED = {"output_attentions": False, "output_hidden_states": False}
# generation-config fields that make transformers run another method than greedy/sampling, with their neutral values
OTHER_METHODS = {"prompt_lookup_num_tokens": None, "assistant_early_exit": None, "use_mtp": False, "num_beams": 1,
                 "num_beam_groups": 1, "penalty_alpha": None, "constraints": None, "force_words_ids": None,
                 "dola_layers": None}
_GENERATE_SIGNATURE = inspect.signature(GenerationMixin.generate)
_GENERATE_PARAMETERS = tuple(_GENERATE_SIGNATURE.parameters)  # self, inputs, generation_config, ..., kwargs
SAMPLE_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def generate_arguments(args, kwargs) -> dict:
    """``generate()``'s arguments by name, positional ones included (``inputs``, ``generation_config``, ...)."""
    named = dict(_GENERATE_SIGNATURE.bind_partial(None, *args, **kwargs).arguments)
    named.pop("self", None)
    named.update(named.pop("kwargs", {}))
    return named


def call_config(model, named: dict):
    """The generation config the call with arguments ``named`` runs with (``generate_arguments``)."""
    return generation.call_generation_config(model, named.get("generation_config"),
                                       **{k: v for k, v in named.items() if k not in _GENERATE_PARAMETERS})


def check_generate_arguments(model, args, kwargs) -> None:
    """Refuse, before any work, what assistant decoding cannot do."""
    if getattr(model, "specfit", None) is None:
        try:
            span = f"1..{hf_layers.moe_layers(model)[0].num_experts}"
        except ValueError as err:  # not a model SpecFit can offload: say that instead
            raise RuntimeError(f"assistant= needs SpecFit, which cannot run this model: {err}") from None
        raise RuntimeError(f"assistant= needs SpecFit enabled on the model first: specfit.enable(model, cache_slots=N, "
                           f"drafter='path/to/eagle3-drafter') with N expert slots per MoE layer in {span}")
    if model.specfit.drafter is None:
        raise ValueError("assistant=... needs a drafter: specfit.enable(model, ..., drafter=PATH_OR_MODULE)")
    named = generate_arguments(args, kwargs)
    if named.get("assistant_model") is not None:
        raise ValueError("pass either assistant= (SpecFit tree decoding) or assistant_model= (transformers), not both")
    if named.get("custom_generate") is not None:
        raise ValueError("pass either assistant= (SpecFit's loop inside generate()) or custom_generate= (a loop of "
                         "your own), not both")
    config = call_config(model, named)
    chosen = {name: getattr(config, name) for name, neutral in OTHER_METHODS.items()
              if getattr(config, name, neutral) not in (None, neutral)}
    if chosen or config.get_generation_mode() not in SAMPLE_MODES:
        shown = ", ".join(f"{k}={v!r}" for k, v in chosen.items()) or "these generate() arguments"
        one = len(chosen) == 1
        method = config.get_generation_mode(named.get("assistant_model")).value.replace("_", " ")
        raise ValueError(f"assistant=... needs greedy or sampling decoding, but {shown} "
                         f"{'selects' if one else 'select'} transformers' {method}: drop assistant= to run that "
                         f"method, or drop {'it' if one else 'them'} to decode with the assistant")
    for name, allowed in UNSUPPORTED.items():
        value = getattr(config, name, None)
        if value not in (None, allowed):
            raise ValueError(f"assistant decoding does not support {name}={value!r} (only {allowed!r})")
    if config.use_cache is False:
        raise ValueError("assistant decoding verifies trees against the KV cache: use_cache=False is not supported")
    for name in ("inputs_embeds", "prefill_chunk_size"):
        if named.get(name, getattr(config, name, None)) is not None:
            raise ValueError(f"assistant decoding does not support {name}= (pass input_ids; prefill in one piece)")
    cache = named.get("cache", named.get("past_key_values"))
    if cache is not None:
        kv_cache.check_cache(cache)
    kv_cache.check_attention(model)
    ids = named.get("inputs") if named.get("inputs") is not None else named.get("input_ids")
    if isinstance(ids, torch.Tensor):
        check_input_ids(model, ids)


def check_input_ids(model, ids: torch.Tensor) -> None:
    """Token ids the model can embed, before its first forward: non-empty, integers inside the vocabulary (on CUDA
    an id outside it is a device-side assert that ends the process). One small reduction per call."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(ids.shape)}): give the prompt at least one token, e.g. "
                         f"the tokenizer's BOS token")
    vocab = model.get_input_embeddings().weight.shape[0]
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    if low < 0 or high >= vocab:
        where = ((ids < 0) | (ids >= vocab)).nonzero()[0].tolist()
        raise ValueError(f"input_ids holds token id {int(ids[tuple(where)])} at position {tuple(where)}, outside "
                         f"this model's vocabulary 0..{vocab - 1}: was the prompt tokenized with this model's "
                         f"tokenizer?")


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
    kv_cache.check_cache(cache)
    cache = kv_cache.ensure_room(model, cache, generation_config.max_length + runtime.options.pool_nodes + 1)
    do_sample = bool(generation_config.do_sample)
    gen = assistant(model)
    run = _Run(input_ids, logits_processor, stopping_criteria, generation_config, streamer, runtime.staging)
    dtype, staging = hf_layers.compute_dtype(model), runtime.staging
    scope = runtime.stats.begin_generate()

    # 0. prefill: the prompt's KV and features; its last logits give the first token (the first root)
    out = model(input_ids, cache=cache, position_ids=model_kwargs.get("position_ids"), use_cache=True,
                logits_to_keep=1)
    features = runtime.aux_capture.features()  # [1, P, 3H]
    scope.prefill_done()  # from here on, everything is decode time: the first token, the drafter's prompt pass
    first = walk(lambda t: [], [], lambda t, acc: run.scores(out.logits[0, -1], acc), do_sample, run.sample)
    run.commit(first)
    kv = input_ids.shape[1]  # positions in the KV cache, known on the host (a static cache counts on the device)
    if not run.done:
        gen.start(features, torch.cat([input_ids[:, 1:], staging.to_device([[run.tokens[-1]]])], dim=1))

    while not run.done:
        t0 = time.perf_counter()
        cycle = Cycle(model, cache, base=kv, root=run.tokens[-1], sampling=do_sample)
        tree = gen.draft(cycle)  # 1. draft
        nodes = gen.select(tree, cycle)  # 2. select
        t_drafted = time.perf_counter()
        layout = verify_layout(tree, nodes, cycle.root, kv, kv_cache.kv_capacity(cache, len(nodes) + 1, kv), dtype,
                               staging)
        masks = None if layout.mask is None else \
            kv_cache.layer_masks(model, cache, layout.mask, layout.position_ids)  # per layer type (sliding windows)
        out = model(layout.tokens, cache=cache, position_ids=layout.position_ids, attention_mask=masks,
                    use_cache=True, logits_to_keep=0)  # 3. verify
        verify = runtime.stats.last_forward
        tokens = [cycle.root] + [tree.tokens[v] for v in layout.nodes]  # the host has them: no device round trip
        choices = None
        if run.plain_greedy:  # 4. accept (one transfer of every position's argmax when scores are raw logits)
            choices = to_host(out.logits[0].argmax(-1))[0].tolist()
            acc = walk_greedy(layout.children, tokens, choices, run.raw_scores(out.logits[0]))
        else:
            acc = walk(layout.children, tokens, lambda t, accepted: run.scores(out.logits[0, t], accepted),
                       do_sample, run.sample)
        gen.learn(tree, layout, acc, choices, do_sample)  # what the target did with the drafted children it saw
        kept = [0] + acc.path  # tree indices, ascending
        prefix = kept == list(range(len(kept)))
        kept_d = None if prefix else staging.to_device(kept)
        if prefix:  # 5. compact: the path is a prefix of the layout, so cropping suffices
            kv_cache.crop_kv(cache, kv + len(kept), current=kv + len(tokens))
        else:
            kv_cache.keep_kv(cache, kv, kept_d)
        kv += len(kept)
        committed = run.commit(acc)  # 6. observe
        if not run.done:
            features = runtime.aux_capture.features()  # [1, n+1, 3H]
            features = features[:, :len(kept)] if prefix else features.index_select(1, kept_d)
            gen.observe(features, staging.to_device([acc.tokens]))
        seconds = time.perf_counter() - t0
        counts = gen.timed(seconds, verify, committed)  # the cycle's clock, verify forward and tokens: may learn
        scope.cycle(pool=len(tree), verified=len(nodes), committed=committed, demand=verify.demand,
                    misses=verify.misses, seconds=seconds, measurement=cycle.measurement_seconds,
                    draft_seconds=t_drafted - t0, expected=gen.expected_tokens, predicted=gen.predicted_seconds,
                    host=verify.host_experts, counts=counts, way=getattr(gen, "arm", ""))

    kv_cache.crop_kv(cache, run.length - 1, current=kv)  # tokens cut by the stopping criteria leave no KV behind
    scope.end(new_tokens=run.length - input_ids.shape[1])
    if streamer is not None:
        streamer.end()
    return run.result(cache)


class _Run:
    """The sequence being generated: logits processing per tree node, committing tokens one by one against the
    stopping criteria (max length, eos, stop strings) exactly as plain decoding does, streaming, outputs.

    The tokens live on the host (``tokens``); their device copy ``ids`` is brought up to date only when something
    reads it (logits processors, stopping criteria other than max length and eos, the result), in one transfer."""

    def __init__(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer, staging):
        self.processors, self.stopping = logits_processor, stopping_criteria
        self.config, self.streamer, self.staging = generation_config, streamer, staging
        self.tokens: list[int] = input_ids[0].tolist()  # one read per call
        self._ids, self._synced = input_ids, len(self.tokens)  # device ids [1, synced]
        self.host_stop = generation.host_stopping(stopping_criteria)  # None: the criteria read device ids
        # greedy with no logits processor and no raw logits kept: the scores are the logits themselves
        self.plain_greedy = not generation_config.do_sample and len(logits_processor) == 0 and \
            not generation_config.output_logits
        self.keep_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        # sampling: Gumbel noise per sequence position, from one seed drawn per call, so the sampled text does not
        # depend on the trees (position_noise.py)
        self.noise = PositionNoise.drawn() if generation_config.do_sample else None
        self.done = False
        self.all_scores, self.all_logits = [], []
        self._raw: list[torch.Tensor] = []  # raw logits behind each scores() call of this cycle, in walk order

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def ids(self) -> torch.Tensor:
        """[1, length] the tokens on the device (appending what the host added since the last read)."""
        if self._synced < len(self.tokens):
            new = self.staging.to_device([self.tokens[self._synced:]]).to(self._ids.dtype)
            self._ids, self._synced = torch.cat([self._ids, new], dim=1), len(self.tokens)
        return self._ids

    def sample(self, i: int, scores: torch.Tensor) -> int:
        """The token sampled from ``scores`` [V] for the i-th place after the committed tokens (keyed by its
        position in the sequence)."""
        return self.noise.sample(self.length + i, scores)

    def raw_scores(self, logits: torch.Tensor):
        """scores_at(t) for the greedy walk: the raw logits row, kept only when output_scores asks for it."""
        return (lambda t: logits[t].float()) if self.keep_scores else (lambda t: None)

    def scores(self, logits: torch.Tensor, accepted: list[int]) -> torch.Tensor:
        """Processed scores [V] for a node reached through ``accepted`` tokens after the committed ones."""
        raw = logits.float()[None]  # [1, V]
        if len(self.processors) == 0 and not self.config.output_logits:
            return raw[0]
        prefix = self.ids if not accepted else torch.cat(
            [self.ids, self.staging.to_device([accepted]).to(self._ids.dtype)], dim=1)
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
            self.tokens.append(token)
            if self.keep_scores:
                self.all_scores.append(scores[None])
            if raw:
                self.all_logits.append(raw[i])
            new.append(token)
            if self._stop():
                self.done = True
                break
        if self.streamer is not None and new:
            self.streamer.put(torch.tensor([new]))
        return len(new)

    def _stop(self) -> bool:
        if self.host_stop is not None:
            return self.host_stop(self.tokens)
        scores = tuple(self.all_scores) if self.keep_scores else None  # what transformers' own loop passes
        return bool(self.stopping(self.ids, scores).any())

    def result(self, cache):
        if not self.config.return_dict_in_generate:
            return self.ids
        return GenerateDecoderOnlyOutput(
            sequences=self.ids,
            scores=tuple(self.all_scores) if self.config.output_scores else None,
            logits=tuple(self.all_logits) if self.config.output_logits else None,
            cache=cache)
