"""Soak: hundreds of mixed calls on one enabled embedded model, as a long-running app makes them.

    python benchmarks/soak.py --calls 300 --json soak.json

Calls rotate through AR, EAGLE-3 and SpecFit, greedy and sampled, short and long, with a streamer now and then, an
option changed with ``configure`` every 25 calls, and (``--threads-every``) a burst of calls from 4 threads at once.
Every greedy call is checked against plain greedy ``generate()`` on the same prompt (lossless, token for token).
Reported: resident memory (RSS) after each third, ms per new token (whole calls, wall clock) of the first and the
last third, and how many greedy outputs matched. A leak or a slowdown shows as the last third drifting from the
first. CPU, emulated link: not GPU speed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch


def rss_mb() -> float:
    """Resident set size of this process, MB (Linux /proc; 0 where it is not available)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--slots", type=int, default=12, help="expert slots per layer (of 64)")
    p.add_argument("--threads-every", type=int, default=50, help="every N calls, 4 calls from 4 threads (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    import specfit
    from specfit import embedded
    from specfit.evaluation import datasets
    from transformers import TextStreamer

    link = embedded.default_link()
    model, tokenizer = embedded.load(args.slots, link=link)
    try:
        texts = datasets.prompts("gsm8k", 6, max_chars=600) + datasets.prompts("cnn", 4, max_chars=900)
    except datasets.DataUnavailable:
        from specfit.evaluation.demo import FALLBACK

        texts = FALLBACK["gsm8k"] + FALLBACK["cnn"]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    rng = random.Random(args.seed)
    reference: dict[tuple[int, int], torch.Tensor] = {}
    lock = threading.Lock()

    def expected(i: int, n: int) -> torch.Tensor:
        with lock:
            if (i, n) not in reference:
                reference[(i, n)] = model.generate(prompts[i], max_new_tokens=n, do_sample=False, assistant=None)
            return reference[(i, n)]

    def one_call(k: int, quiet_streamer) -> tuple[float, int, bool | None]:
        i = rng.randrange(len(prompts))
        method = ("ar", "eagle3", "specfit")[k % 3]
        sample = k % 7 == 3
        n = rng.choice((8, 24, 48))
        kw = dict(max_new_tokens=n, do_sample=sample, assistant=None if method == "ar" else method)
        if sample:
            kw.update(temperature=0.8, top_p=0.95)
        if k % 11 == 5:
            kw["streamer"] = quiet_streamer
        t0 = time.perf_counter()
        out = model.generate(prompts[i], **kw)
        seconds = time.perf_counter() - t0
        new = out.shape[1] - prompts[i].shape[1]
        same = None if sample else torch.equal(out, expected(i, n))
        return seconds, new, same

    class Quiet(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            pass

    quiet = Quiet(tokenizer, skip_prompt=True)
    for i in range(len(prompts)):  # references first: their calls are not part of the soak
        for n in (8, 24, 48):
            expected(i, n)
    records, thirds, started = [], [], time.time()
    k = 0
    while k < args.calls:
        if args.threads_every and k and k % args.threads_every == 0:
            results = [None] * 4
            ts = [threading.Thread(target=lambda j=j: results.__setitem__(j, one_call(k + j, quiet))) for j in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            records += results
            k += 4
        else:
            records.append(one_call(k, quiet))
            k += 1
        if k % 25 == 0:
            specfit.configure(model, max_nodes=rng.choice((5, 7)))
        if len(records) >= (len(thirds) + 1) * args.calls / 3:
            thirds.append(rss_mb())
    third = len(records) // 3

    def ms_per_token(rs):
        return 1e3 * sum(s for s, _, _ in rs) / max(1, sum(n for _, n, _ in rs))

    greedy = [same for _, _, same in records if same is not None]
    report = dict(calls=len(records), slots=args.slots, link=model.specfit.link_label,
                  link_ms=embedded.link_seconds_per_expert(link) * 1e3, wall_seconds=time.time() - started,
                  greedy_identical=sum(greedy), greedy_calls=len(greedy), rss_mb_after_each_third=thirds,
                  rss_growth_mb_last_two_thirds=thirds[-1] - thirds[0] if thirds else 0.0,
                  ms_per_token_first_third=ms_per_token(records[:third]),
                  ms_per_token_last_third=ms_per_token(records[-third:]),
                  median_ms_per_token=statistics.median(1e3 * s / max(1, n) for s, n, _ in records))
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["greedy_identical"] == report["greedy_calls"] else 1


if __name__ == "__main__":
    sys.exit(main())
