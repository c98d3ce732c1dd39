"""Choose the acceptance model's prior strength and decay offline: record label streams once, replay them many times.

``record`` decodes tuning prompts with the EAGLE-3 assistant on the embedded model (greedy; all 64 experts resident)
and keeps, per cycle, the ``(depth, rank, q, label)`` of every drafted child it labels. The prompts are disjoint
from the tables' calibration prompts: GSM8K train questions 100.. and CNN/DailyMail articles 24.. from the end of
the test file. ``replay`` runs ``AcceptanceModel`` over the streams, workload after workload as the bench does,
predicting each cycle's children before learning their labels, and prints the per-node calibration error for a
grid of (strength, decay), from the drafter's tables and from the default prior. ``--sparse`` keeps only depth-1
labels of every third cycle: SpecFit when it mostly skips drafting and only probes.

    python benchmarks/acceptance_replay.py record --prompts 16 --out streams.json
    python benchmarks/acceptance_replay.py replay streams.json [--sparse]
"""

import argparse
import itertools
import json
import warnings

from specfit.evaluation.reliability import ece, ece_floor
from specfit.selection.acceptance_model import FILENAME, AcceptanceModel, AcceptanceTables


def record(args) -> None:
    import torch

    from specfit import embedded
    from specfit.decoding.acceptance import child_labels
    from specfit.decoding.assistants import Eagle3Generator
    from specfit.evaluation import datasets

    class Recorder(Eagle3Generator):
        def __init__(self, model, cycles):
            super().__init__(model)
            self.cycles = cycles

        def learn(self, tree, layout, acc, choices, sampling):
            nodes, labels = child_labels(tree, layout, acc, choices, sampling)
            self.cycles.append([(tree.depths[v], tree.ranks[v], tree.qs[v], y) for v, y in zip(nodes, labels)])

    warnings.simplefilter("ignore", RuntimeWarning)
    torch.set_num_threads(1)
    model, tokenizer = embedded.load(64)
    n = args.prompts
    texts = {"gsm8k": [datasets.GSM8K_PROMPT.format(question=r["question"])
                       for r in datasets.gsm8k("train", 100 + n)[100:]],
             "cnn": [datasets.CNN_PROMPT.format(article=r["article"][:1500])
                     for r in datasets.cnn_dailymail()[::-1][24:24 + n]]}
    streams = {}
    for name, prompts in texts.items():
        streams[name] = []
        for text in prompts:
            cycles: list = []
            ids = tokenizer(text, return_tensors="pt").input_ids[:, -450:]
            model.generate(ids, max_new_tokens=64, do_sample=False, assistant=lambda m: Recorder(m, cycles))
            streams[name].append(cycles)
    with open(args.out, "w") as f:
        json.dump(streams, f)
    print({name: sum(len(c) for p in prompts for c in p) for name, prompts in streams.items()}, "labels")


def replay(args) -> None:
    from specfit import embedded

    with open(args.streams) as f:
        streams = json.load(f)
    if args.sparse:
        streams = {w: [[[x for x in c if x[0] == 1] if i % 3 == 0 else [] for i, c in enumerate(p)] for p in ps]
                   for w, ps in streams.items()}
    tables = {"drafter's": AcceptanceTables.load(embedded.DRAFTER_DIR / FILENAME),
              "default": AcceptanceTables.default()}
    for (name, t), strength, decay in itertools.product(tables.items(), (1, 2, 4, 8, 16), (0.95, 0.98, 0.99, 1.0)):
        model = AcceptanceModel(t.greedy, strength, decay)
        cells = []
        for workload in ("gsm8k", "cnn"):
            predicted, labels = [], []
            for prompt in streams[workload]:
                for cycle in prompt:
                    if cycle:
                        predicted += [model.predict(d, r, q) for d, r, q, _ in cycle]
                        labels += [y for *_, y in cycle]
                        model.update(cycle)
            cells.append(f"{workload} {ece(predicted, labels):.3f} (floor {ece_floor(predicted):.3f}, "
                         f"{len(labels)} labels)")
        print(f"{name:<9} strength {strength:<3} decay {decay:<5} " + "  ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("--prompts", type=int, default=16, help="tuning prompts per workload")
    r.add_argument("--out", default="streams.json")
    s = sub.add_parser("replay")
    s.add_argument("streams")
    s.add_argument("--sparse", action="store_true", help="only depth-1 labels of every third cycle")
    args = p.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
