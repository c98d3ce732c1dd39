"""``specfit train-router``: the command around ``training/router.py`` (collecting (drafter state, true routes) pairs
while decoding, and training the route predictor on them): its options, checked before anything heavy is imported,
and the run, which saves the predictor beside the drafter (or to ``--out``) with a report of its held-out recall."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from .. import cli_checks


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="target checkpoint (default: the embedded model)")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the embedded drafter)")
    p.add_argument("--out", default=None, help="where to save (default: beside a --drafter folder given; with the "
                                               "embedded drafter, required)")
    p.add_argument("--num-prompts", type=int, default=48, help="GSM8K train questions decoded to collect routes")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt")
    p.add_argument("--epochs", type=int, default=40, help="passes over the collected routes")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, init and batches")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--save-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of the saved head (bfloat16 halves the file; recall is measured on the saved head)")


def check_arguments(args) -> None:
    """Every option, before anything heavy is imported: the folders, --out, the counts."""
    from ..embedded.paths import DRAFTER_DIR

    if args.model:
        cli_checks.moe_folder(args.model, "--model")
    if args.drafter:
        cli_checks.folder(args.drafter, "--drafter", must_hold="config.json")
    if args.out is None and args.drafter is None:
        raise ValueError(f"--out is needed with the embedded drafter (the default would write into the installed "
                         f"package); to replace the shipped route predictor in a source checkout: --out "
                         f"{DRAFTER_DIR}")
    if args.out is not None:
        cli_checks.writable(args.out, "--out")
    elif args.drafter is not None:
        cli_checks.writable(args.drafter, "--drafter")  # without --out the predictor is saved there
    cli_checks.at_least(args, 2, "num_prompts", why="half GSM8K questions, half OpenStax passages")
    cli_checks.at_least(args, 1, "max_new_tokens", "epochs", "threads")


def main(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from ..evaluation import datasets
    from .. import embedded
    from ..patch import from_pretrained
    from ..selection.route_predictor import RoutePredictor, recall
    from .router import collect, train

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = Path(args.model) if args.model else embedded.TARGET_DIR
    drafter_dir = Path(args.drafter) if args.drafter else embedded.DRAFTER_DIR
    out = Path(args.out) if args.out else drafter_dir
    config = json.loads((model_dir / "config.json").read_text())
    num_experts = cli_checks.experts_per_layer(config)  # all resident: collection is not timed
    model = from_pretrained(model_dir, cache_slots=num_experts, dtype=torch.float32, device="cpu",
                            drafter=str(drafter_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(args.seed)
    half = args.num_prompts // 2
    texts = [datasets.GSM8K_PROMPT.format(question=r["question"]) for r in datasets.gsm8k("train", 2000)]
    texts = rng.sample(texts, half)
    sections = [r["text"] for r in datasets.openstax() if len(r["text"]) > 800]
    texts += [datasets.CNN_PROMPT.format(article=t[:1500]) for t in rng.sample(sections, args.num_prompts - half)]
    ids = [tokenizer(t, return_tensors="pt").input_ids[:, -450:] for t in texts]

    t0 = time.time()
    states, routes = collect(model, ids, args.max_new_tokens)
    order = torch.randperm(len(states), generator=torch.Generator().manual_seed(args.seed))
    split = int(0.85 * len(states))
    tr, te = order[:split], order[split:]
    gate = RoutePredictor.from_gates(model)
    head = RoutePredictor.from_gates(model)
    losses = train(head, states[tr], routes[tr], epochs=args.epochs, seed=args.seed)
    head.save(out, dtype=getattr(torch, args.save_dtype))
    head = RoutePredictor.load(out)  # measured as saved
    with torch.no_grad():
        r_gate = recall(gate.routes(states[te]), routes[te])
        r_pred = recall(head.routes(states[te]), routes[te])
    report = dict(pairs=len(states), train=len(tr), heldout=len(te), epochs=args.epochs, final_loss=losses[-1],
                  recall_gate_per_layer=r_gate.tolist(), recall_predictor_per_layer=r_pred.tolist(),
                  recall_gate=float(r_gate.mean()), recall_predictor=float(r_pred.mean()),
                  prompts=f"{half} GSM8K train questions + {args.num_prompts - half} OpenStax passages",
                  seconds=time.time() - t0)
    (out / "route_predictor_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{len(states)} (state, routes) pairs from {len(ids)} prompts; held out {len(te)}")
    print("per-layer top-k recall on held-out pairs:")
    print("  gate      " + " ".join(f"{x:.3f}" for x in r_gate.tolist()) + f"   mean {float(r_gate.mean()):.3f}")
    print("  predictor " + " ".join(f"{x:.3f}" for x in r_pred.tolist()) + f"   mean {float(r_pred.mean()):.3f}")
    print(f"saved to {out}")
    return 0
