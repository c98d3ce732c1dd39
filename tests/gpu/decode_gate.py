"""The decode check's correctness gate (``decode_check.py --reference``): decoding through the slot cache at real
shapes, checked against references that round differently but must decode the same.

A GPU rounds the slot cache's grouped matmuls and the reference's gathered ``bmm`` differently, so two correct passes
differ by ulps; with random routers a router near-tie then switches one expert of a token, which moves that token's
experts output by its whole spread (issue 39). So the gate checks decoding, not rounding:

1. *Experts and logits, routes replayed.* The reference pass (every expert read from its host row: no slots, no
   LRU) decodes greedily and records each experts call's routes; the checked pass (through the slot cache, from
   empty slots, teacher-forced on the reference's tokens) is handed exactly those routes by a forward pre-hook on
   each experts module, and its router's own disagreements are counted apart. A gap is max |diff| over the reference
   row's standard deviation: a wrong expert, slot or routing weight moves a row by about its whole spread, rounding
   by a few hundredths.
2. *One layer against transformers.* The first MoE layer's prefill call, on the reference's inputs and routes,
   through SpecFit's experts (the slot cache) and through transformers' own experts forward on the stored weights
   (``ExpertStore.checkpoint_tensors``): what both passes above share (the arenas' contents, the routing weights'
   multiply and sum) against code that is not SpecFit's.
3. *Tokens.* An assistant's greedy output (tree verify, KV compaction, acceptance) teacher-forced through the
   reference: where a token is not the reference's argmax, the check fails if the reference's top-1/top-2 margin is
   over ``factor`` x the step's numeric gap (max |slot cache - reference| over that step's logits, one token at a
   time with the router's own routes; at least one ulp of the top logit), else it counts the step as a tie broken
   the other way.

``other_rounding(model)`` emulates, on a CPU, a GPU's different accumulation order in every pass but the reference
(the experts' matmuls in a wider dtype, rounded once at the end): the gate's tests show that correct code passes
under it and that a wrong expert, slot, routing weight or tree mask does not.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from specfit.offload.experts import ATTR
from specfit.seam import experts as hf_experts, layers as hf_layers

TOLERANCE = 0.25  # largest gap in standard deviations (see reference_gap)
FACTOR = 5.0  # a disagreement fails where the reference's margin is over FACTOR x the step's gap (token_check)


def fresh_slots(rt) -> None:
    """Empty every slot and the emulated link's queue: the state of a freshly loaded model."""
    rt.engine.drain()
    rt.clear_cache()
    if rt.engine.link is not None:
        rt.engine.link.reset()


def experts_modules(model) -> list:
    """The experts modules SpecFit serves, in layer order."""
    return [m for m in model.modules() if hasattr(m, ATTR)]


def greedy_logits(model, prompt: torch.Tensor, new_tokens: int, tokens: list[int] | None = None):
    """(prefill logits [P, vocab], the steps' logits [new_tokens, vocab], both float32; the tokens fed): greedy on
    its own logits, or teacher-forced on ``tokens``, one token per forward."""
    from transformers import DynamicCache

    cache, rows, fed = DynamicCache(config=model.config), [], []
    with torch.no_grad():
        prefill = model(prompt, cache=cache, use_cache=True).logits[0].float()  # [P, vocab]
        logits = prefill[-1]
        for step in range(new_tokens):
            fed.append(int(logits.argmax()) if tokens is None else tokens[step])
            nxt = torch.tensor([[fed[-1]]], device=prompt.device)
            logits = model(nxt, cache=cache, use_cache=True).logits[0, -1].float()  # [vocab]
            rows.append(logits)
    return prefill, torch.stack(rows), fed


def gaps(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    """Per row of [n, d]: max |got - want| over the standard deviation of ``want``'s row."""
    return ((got - want).abs().amax(dim=1) / want.std(dim=1).clamp_min(1e-6)).tolist()


class ExpertOutputs:
    """Records every experts module's output [T, H] (float32), in call order, while active."""

    def __init__(self, model):
        self.modules = experts_modules(model)
        self.outputs: list[torch.Tensor] = []
        self.handles = []

    def __enter__(self):
        self.outputs.clear()
        self.handles = [m.register_forward_hook(lambda _m, _a, out: self.outputs.append(out.detach().float()))
                        for m in self.modules]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class RouteReplay:
    """Forward pre-hooks on every experts module. ``record()``: keeps each call's routes (top_k_index, top_k_weights
    [T, k]) in call order, and the first module's first call whole (hidden_states [T, H] too). ``replay()``: hands
    the recorded routes to the same calls, in the same order, in place of the router's, and counts the router's own
    disagreements: ``routes`` token routes seen, ``disagreements`` of them whose expert set differs."""

    NAMES = ("hidden_states", "top_k_index", "top_k_weights")

    def __init__(self, model):
        self.modules = experts_modules(model)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.first_call: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.routes = self.disagreements = 0
        self._next = 0

    @staticmethod
    def _get(args, kwargs):
        return [args[i] if i < len(args) else kwargs[name] for i, name in enumerate(RouteReplay.NAMES)]

    @staticmethod
    def _set(args, kwargs, index, weights):
        values = {1: index, 2: weights}
        args = tuple(values.get(i, a) for i, a in enumerate(args))
        kwargs = {k: values.get(RouteReplay.NAMES.index(k), v) if k in RouteReplay.NAMES else v
                  for k, v in kwargs.items()}
        return args, kwargs

    @contextmanager
    def _hooked(self, hook):
        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in self.modules]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def record(self):
        self.calls.clear()
        self.first_call = None

        def hook(module, args, kwargs):
            hidden, index, weights = self._get(args, kwargs)
            self.calls.append((index.detach().clone(), weights.detach().clone()))
            if self.first_call is None and module is self.modules[0]:
                self.first_call = (hidden.detach().clone(), *self.calls[-1])

        return self._hooked(hook)

    @contextmanager
    def replay(self):
        self._next, self.routes, self.disagreements = 0, 0, 0

        def hook(module, args, kwargs):
            _, index, _ = self._get(args, kwargs)
            if self._next >= len(self.calls):
                raise RuntimeError(f"the checked pass made more experts calls than the reference's {len(self.calls)}")
            want_index, want_weights = self.calls[self._next]
            self._next += 1
            if index.shape != want_index.shape:
                raise RuntimeError(f"experts call {self._next}: routes {tuple(index.shape)} in the checked pass, "
                                   f"{tuple(want_index.shape)} in the reference")
            self.routes += index.shape[0]
            self.disagreements += int((index.sort(dim=1).values != want_index.sort(dim=1).values).any(dim=1).sum())
            return self._set(args, kwargs, want_index, want_weights)

        with self._hooked(hook):
            yield self
        if self._next != len(self.calls):
            raise RuntimeError(f"the checked pass made {self._next} experts calls, the reference {len(self.calls)}")


def transformers_layer_gap(model, call) -> dict:
    """The first MoE layer's call ``call`` = (hidden_states [T, H], top_k_index, top_k_weights [T, k]) through
    SpecFit's experts (the slot cache, from empty slots) and through transformers' own experts forward on the stored
    weights; the worst row's gap (see ``gaps``) and how many experts the call routed to."""
    rt = model.specfit
    module = experts_modules(model)[0]
    layer = getattr(module, ATTR).index
    hidden, index, weights = call
    transposed = hf_layers.moe_layers(model)[layer].transposed
    params = {name: t.to(hidden.device) for name, t in rt.store.checkpoint_tensors(layer, transposed).items()}
    fresh_slots(rt)
    with torch.no_grad(), rt.serialized("the decode gate"):
        rt.begin_forward()
        try:
            mine = module(hidden, index, weights)  # [T, H]
        finally:
            rt.end_forward()
        theirs = hf_experts.transformers_experts_forward(module, params, hidden, index, weights)  # [T, H]
    return dict(layer_gap=max(gaps(mine.float(), theirs.float())), layer_experts=int(index.unique().numel()),
                layer_tokens=int(hidden.shape[0]))


def reference_gap(model, prompt: torch.Tensor, new_tokens: int, replay: bool = True) -> dict:
    """Checks 1 and 2 of the module docstring on ``prompt`` and ``new_tokens`` greedy steps: every MoE layer's
    experts output (each token row, every forward), the prefill logits (every position) and each step's logits, the
    routes replayed (``replay=False``: the checked pass routes on its own, as the gate did before issue 39), and the
    first layer against transformers. Gaps in standard deviations of the reference's rows."""
    rt = model.specfit
    record, routes = ExpertOutputs(model), RouteReplay(model)
    with rt.measurement(), record, routes.record():  # every expert from its host row: no slots
        want_p, want, tokens = greedy_logits(model, prompt, new_tokens)
    want_e = list(record.outputs)
    fresh_slots(rt)
    with record, (routes.replay() if replay else _nothing()):
        got_p, got, _ = greedy_logits(model, prompt, new_tokens, tokens)
    got_e = list(record.outputs)
    if len(got_e) != len(want_e) or not want_e:
        raise RuntimeError(f"{len(got_e)} experts outputs through the slot cache, {len(want_e)} in the reference")
    experts_gap = max(max(gaps(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))) for a, b in zip(got_e, want_e))
    steps = gaps(got, want)
    prefill = max(gaps(got_p, want_p))
    same = int((got.argmax(dim=1) == want.argmax(dim=1)).sum())
    layer = transformers_layer_gap(model, routes.first_call)
    return dict(experts_gap=experts_gap, step_gaps=steps, prefill_gap=prefill,
                max_gap=max([experts_gap, prefill, layer["layer_gap"]] + steps), same_argmax=same, steps=new_tokens,
                layer_outputs=len(got_e), replayed=replay, route_disagreements=routes.disagreements if replay else None,
                routes=routes.routes, grouped=bool(rt.grouped_experts), slots=rt.layers[0].cache.num_slots,
                experts=rt.num_experts, tokens=tokens, **layer)


@contextmanager
def _nothing():
    yield


def token_check(model, prompt: torch.Tensor, tokens: list[int], factor: float = FACTOR) -> dict:
    """Check 3 of the module docstring: ``tokens`` (an assistant's greedy output after ``prompt``) teacher-forced
    through the reference and, for each step's numeric gap, through the slot cache one token at a time."""
    rt = model.specfit
    n = len(tokens)
    with rt.measurement():
        ref_p, ref, _ = greedy_logits(model, prompt, n, tokens)
    fresh_slots(rt)
    slot_p, slot, _ = greedy_logits(model, prompt, n, tokens)
    want = torch.cat([ref_p[-1:], ref[:-1]])  # [n, vocab]: the logits token t is chosen from
    have = torch.cat([slot_p[-1:], slot[:-1]])  # [n, vocab]
    top = want.topk(2, dim=1).values  # [n, 2]
    margin = top[:, 0] - top[:, 1]  # [n]
    ulp = torch.finfo(model.get_output_embeddings().weight.dtype).eps * top[:, 0].abs()  # [n]
    bound = factor * torch.maximum((have - want).abs().amax(dim=1), ulp)  # [n]
    given = torch.tensor(tokens, device=want.device)
    differ = given != want.argmax(dim=1)  # [n]
    fail = differ & (margin > bound)
    failures = [dict(step=int(t), token=int(given[t]), reference=int(want[t].argmax()), margin=float(margin[t]),
                     bound=float(bound[t])) for t in fail.nonzero().flatten().tolist()]
    return dict(steps=n, equal=int((~differ).sum()), ties=int((differ & ~fail).sum()), failures=failures,
                factor=factor, worst_margin_over_bound=float((margin / bound)[differ].max()) if differ.any() else None)


def token_line(name: str, check: dict) -> str:
    verdict = "FAIL" if check["failures"] else "pass"
    line = (f"RESULT tokens {name}: {verdict}: {check['steps']} greedy tokens teacher-forced through the reference: "
            f"{check['equal']} its argmax, {check['ties']} near-ties broken the other way (margin within "
            f"{check['factor']:g}x the step's numeric gap), {len(check['failures'])} disagreements over it")
    if check["failures"]:
        f = check["failures"][0]
        line += (f" (first: step {f['step']}, token {f['token']} where the reference says {f['reference']} by a "
                 f"margin of {f['margin']:.4g}, bound {f['bound']:.4g})")
    return line


def reference_line(ref: dict, tol: float = TOLERANCE) -> str:
    verdict = "pass" if ref["max_gap"] <= tol else "FAIL"
    routes = ("the router's own routes (not replayed)" if not ref["replayed"] else
              f"the reference's routes replayed; the router disagreed on {ref['route_disagreements']} of "
              f"{ref['routes']} token routes")
    return (f"RESULT reference: {verdict}: slot cache ({ref['slots']} of {ref['experts']} slots, "
            f"{'grouped' if ref['grouped'] else 'gathered'} experts) vs all-resident reference, {routes}; gaps in "
            f"standard deviations (tolerance {tol:g}): experts outputs {ref['experts_gap']:.4f} (worst of "
            f"{ref['layer_outputs']} layer forwards), prefill logits {ref['prefill_gap']:.4f}, worst of "
            f"{ref['steps']} greedy steps {max(ref['step_gaps']):.4f}; argmax equal at {ref['same_argmax']}/"
            f"{ref['steps']}; transformers' own experts forward on the stored weights, first MoE layer's prefill "
            f"({ref['layer_tokens']} tokens, {ref['layer_experts']} experts): {ref['layer_gap']:.4f}")


@contextmanager
def other_rounding(model):
    """Every experts forward outside the reference (``model.specfit.untracked`` off) computed in a wider dtype
    (float32 for half-precision models, float64 for float32) and rounded once at the end: on a CPU, a GPU's
    different accumulation order, as review 4 emulated it."""
    saved = hf_experts.experts_forward_batched, hf_experts.experts_forward_grouped

    def wider(fn):
        def run(experts, x, *weights):
            if model.specfit.untracked:
                return fn(experts, x, *weights)
            wide = torch.float64 if x.dtype == torch.float32 else torch.float32
            return fn(experts, x.to(wide), *(w.to(wide) if isinstance(w, torch.Tensor) and w.is_floating_point()
                                             else w for w in weights)).to(x.dtype)
        return run

    hf_experts.experts_forward_batched, hf_experts.experts_forward_grouped = (wider(f) for f in saved)
    try:
        yield
    finally:
        hf_experts.experts_forward_batched, hf_experts.experts_forward_grouped = saved
