"""Calls on one enabled model from many threads (a Gradio or FastAPI app): serialised per model, so every output is
the one a lone call gives; two models in one process stay independent."""

import logging
import threading

import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.selection.cost_model import CostModel

COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)  # a resident expert costs its compute, a missing one 5x that
PROMPTS = [torch.tensor([[5, 17, 99, 3, 42, 7]]), torch.tensor([[9, 2, 77, 31]]), torch.tensor([[8, 8, 120, 4, 66]])]
METHODS = (None, "eagle3", "specfit")


def enabled(seed=0):
    model = tiny_moe(seed)
    drafter = SelfDrafter(model, first_token=int(PROMPTS[0][0, 0]), noise=0.3)
    return specfit.enable(model, cache_slots=3, drafter=drafter, cost_model=COST)


def run(model, prompt, method, new=12):
    kw = {} if method is None else {"assistant": method}
    return model.generate(prompt, max_new_tokens=new, do_sample=False, **kw)


def hammer(jobs, threads=6):
    """Run ``jobs`` [(model, prompt, method)] from ``threads`` threads at once; returns outputs by job index."""
    out, errors, lock = {}, [], threading.Lock()
    start = threading.Barrier(threads)

    def worker(w):
        start.wait()
        for i in range(w, len(jobs), threads):
            try:
                result = run(*jobs[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
                continue
            with lock:
                out[i] = result

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    return out


def test_threads_on_one_model_get_the_outputs_a_lone_call_gets(caplog):
    reference = tiny_moe()
    expected = {p: reference.generate(PROMPTS[p], max_new_tokens=12, do_sample=False) for p in range(len(PROMPTS))}
    model = enabled()
    jobs = [(model, PROMPTS[i % 3], METHODS[(i // 3) % 3]) for i in range(18)]
    with caplog.at_level(logging.DEBUG, logger="specfit"):
        out = hammer(jobs)
    wrong = [i for i, (_, prompt, method) in enumerate(jobs)
             if not torch.equal(out[i], expected[next(p for p in range(3) if PROMPTS[p] is prompt)])]
    assert not wrong, f"{len(wrong)} of {len(jobs)} concurrent calls returned other tokens: {wrong}"
    assert any("waits for a call in another thread" in r.getMessage() for r in caplog.records)


def test_a_call_that_waited_shows_its_wait():
    model = enabled()
    rt = model.specfit
    rt.lock.acquire()  # another thread's call in progress
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", run(model, PROMPTS[0], "specfit")))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # it waits ...
    rt.lock.release()
    t.join()
    g = rt.stats.last_generate
    assert g.lock_wait_seconds >= 0.25 and g.prefill_seconds >= g.lock_wait_seconds  # ... and says so, in its clock


def test_two_models_in_one_process_stay_independent():
    a, b = enabled(0), enabled(1)
    ref_a, ref_b = tiny_moe(0), tiny_moe(1)
    jobs = [(a if i % 2 == 0 else b, PROMPTS[i % 3], METHODS[i % 3]) for i in range(12)]
    out = hammer(jobs, threads=4)
    for i, (model, prompt, _) in enumerate(jobs):
        ref = ref_a if model is a else ref_b
        assert torch.equal(out[i], ref.generate(prompt, max_new_tokens=12, do_sample=False)), i
