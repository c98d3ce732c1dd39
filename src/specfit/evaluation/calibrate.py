"""``specfit calibrate``: fit this machine's cycle-time model ``intercepts[n] + beta * demand + copy * misses`` for a
model, check it, and install it where ``specfit.enable`` finds it only if it is good enough. One calibration per
machine and model: the profile prices any slot count, cache mode and link (``selection/cost_model.py``).

The probes, their rounds and the fit are ``specfit.evaluation.probes`` (``calibrate``); this module is the command
around them: its arguments, ``fit_profile`` for a model built in code, and installing (only a good fit), describing
and plotting a profile.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path

from .. import cli_checks
from ..calibration import LEAST, PROBES
from .profile_report import describe, plot_fit  # describe: also bench's

WHY_LEAST = {"probes": "each fit of the 5-fold cross-validation needs more records than coefficients",
             "bootstrap": "refits for the 95% intervals",
             "max_new_tokens": f"the first {PROBES['warmup_cycles']} cycles of a prompt warm up and are not probes"}
ACCEPTANCE_PROMPTS = 24  # --acceptance-only: calibration prompts (each decoded greedily and sampled)


class CalibrationRefused(RuntimeError):
    """``specfit.calibrate`` fitted a profile that failed the quality gate, so it installed nothing: ``profile`` is
    the rejected ``CostModel`` (its ``quality`` says why), ``path`` where a copy was written for inspection (a name
    ``enable`` never reads). ``force=True`` installs such a fit anyway."""

    def __init__(self, message: str, profile, path: Path):
        super().__init__(message)
        self.profile, self.path = profile, path


def fit_profile(model, prompts, *, out=None, force: bool = False, **options):
    """Calibrate this machine for ``model`` (enabled, with a drafter) and install the profile where ``enable`` finds
    it, as ``specfit calibrate`` does, for a model built in code: ``prompts`` are token-id tensors ([1, P] or [P])
    or lists of ids; ``options`` go to the probes (``probes``, ``repeats``, ``bootstrap``, ``max_new_tokens``,
    ``seed``, ``links``, ...), checked before any probe runs. Keep one CPU thread (``torch.set_num_threads(1)``) on a
    CPU: more make the timer noisy.

    Returns the installed profile (priced for the model's link). A poor fit is not installed: it raises
    ``CalibrationRefused`` (the reasons and the remedy in its message, the rejected profile as ``.profile``); with
    ``force=True`` it is installed anyway, with a ``RuntimeWarning`` (and ``enable`` warns whenever it loads it)."""
    import torch

    from ..selection.profile_files import profile_path
    from ..selection.profiles import profile_key
    from .probes import calibrate

    ids = [p if isinstance(p, torch.Tensor) else torch.tensor(p) for p in prompts]
    ids = [(p if p.dim() == 2 else p[None]).to(model.specfit.device) for p in ids]
    if not ids:
        raise ValueError("specfit.calibrate needs at least one prompt (token ids of the model's tokenizer)")
    result = calibrate(model, ids, **options)
    install(result.cost, Path(out) if out else profile_path(**profile_key(model)), force=force, python=True)
    return result.cost


# --- the command ------------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the embedded model)")
    p.add_argument("--fp8", action="store_true",
                   help="the embedded model's FP8 variant (a model of its own: its profile is filed apart)")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the embedded drafter)")
    p.add_argument("--slots", type=int, default=None,
                   help="expert slots per MoE layer on the device (default: 3/8 of the model's experts per layer, "
                        "the paper's 48 of 128: 24 for the embedded model's 64; with --acceptance-only, all of them)")
    p.add_argument("--cache-mode", choices=("cached", "cleared"), default="cached",
                   help="'cached': slots keep experts across forwards (by the slot cache's policy, 'forecast' by "
                        "default); 'cleared': emptied before every forward")
    p.add_argument("--prompts", default=PROBES["prompts"],
                   help="gsm8k (default, as in the paper), cnn, random (token ids; for checkpoints without a "
                        "tokenizer), or a local .jsonl with a 'question' or 'text' field")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts to decode (default {PROBES['num_prompts']}; with --acceptance-only, "
                        f"{ACCEPTANCE_PROMPTS})")
    p.add_argument("--probes", type=int, default=PROBES["probes"],
                   help="probe configurations (cycles) to fit on")
    p.add_argument("--repeats", type=int, default=PROBES["repeats"],
                   help="timed repeats of each configuration; its fastest is fitted")
    p.add_argument("--bootstrap", type=int, default=PROBES["bootstrap"], help="bootstrap refits for the intervals")
    p.add_argument("--max-new-tokens", type=int, default=PROBES["max_new_tokens"],
                   help="tokens generated per prompt (each cycle is a probe)")
    p.add_argument("--link-ms", type=float, default=None, help="emulated host link: milliseconds per expert copy")
    p.add_argument("--default-link", type=float, nargs="?", const=1.0, default=None, metavar="RATIO",
                   help="the embedded model's structural default link (a token's expert copies = 1.4x its compute, "
                        "which this command measures again and keeps for the next runs), times RATIO (default 1): "
                        "what the demo and the bench use")
    p.add_argument("--host-ratio", type=float, default=None, metavar="RATIO",
                   help="the probes' host-lane rounds (every cold expert computed on an emulated host lane, on a CPU): "
                        "the embedded model's structural default host lane at RATIO x the link's bandwidth (default "
                        "2.5, and the same at half its bandwidth); 0: no host-lane rounds (the profile then prices "
                        "host experts at the lane's own time)")
    p.add_argument("--lane-seconds", type=float, default=None, metavar="S",
                   help="the most seconds the host-lane rounds may take, estimated from the lane's measured time per "
                        "expert before they start; over it they are skipped, said why (default: no bound)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="the dtype the model computes in (default: the checkpoint's; the embedded model's: float32); "
                        "a profile is filed under it, so each dtype gets one of its own, e.g. for "
                        "specfit.embedded.load(..., dtype=torch.bfloat16)")
    p.add_argument("--device", default=None,
                   help="cuda | cuda:N | cpu (default: cuda when available; the embedded model: cpu only)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on a CPU device: 1, as `specfit bench` and `demo` use; more "
                        "threads fight other jobs for the cores and make the timer noisy)")
    p.add_argument("--seed", type=int, default=PROBES["seed"], help="seed for the probe schedule and bootstrap")
    p.add_argument("--out", default=None, help="profile path (default: the user cache, where enable() looks)")
    p.add_argument("--force", action="store_true",
                   help="install the profile even when the fit fails the quality gate (enable() will warn)")
    p.add_argument("--plot", default=None,
                   help="PNG of predicted vs measured cycle time (default: beside the profile; needs matplotlib); "
                        "'none': no plot")
    p.add_argument("--acceptance-only", action="store_true",
                   help="instead of the cost profile, fit the acceptance model's tables for the drafter: greedy and "
                        "sampling labels from the EAGLE-3 assistant on GSM8K train questions and CNN/DailyMail "
                        "articles from the end of the test file (--num-prompts of them, default 24), written to "
                        "the user cache under the drafter's content, where enable() reads them before the drafter "
                        "folder's own acceptance.json (or to --out); --slots defaults to all experts")


def check_arguments(args) -> None:
    """Every option, before anything loads (``specfit.cli`` calls this before ``main``): counts and ranges, the
    model's config (a folder's ``config.json``, or a hub id's), the drafter folder, the prompts, the link, the device.
    Reads JSON only: no torch, no model."""
    from ..embedded.paths import DRAFTER_DIR, TARGET_DIR

    check = cli_checks
    if args.fp8 and args.model is not None:
        raise ValueError("--fp8 picks the embedded model's FP8 variant; for a checkpoint of your own give --model "
                         "FOLDER alone (its config says how its experts are stored)")
    for name, low in LEAST.items():
        check.at_least(args, low, name, why=WHY_LEAST.get(name))
    check.at_least(args, 1, "threads")
    check.milliseconds(args, "link_ms")
    if args.host_ratio is not None and not (math.isfinite(args.host_ratio) and args.host_ratio >= 0):
        raise ValueError(f"--host-ratio must be a finite number >= 0 (0: no host-lane rounds), got {args.host_ratio}")
    if args.lane_seconds is not None and not (math.isfinite(args.lane_seconds) and args.lane_seconds > 0):
        raise ValueError(f"--lane-seconds must be a finite number of seconds > 0, got {args.lane_seconds}")
    if args.default_link is not None and not args.default_link >= 0:
        raise ValueError(f"--default-link RATIO scales the structural default link, a number >= 0 (0: no link), got "
                         f"{args.default_link}")
    if args.default_link is not None and args.link_ms is not None:
        raise ValueError("give --link-ms or --default-link, not both")
    if args.model is None and args.device is not None and not args.device.startswith("cpu"):
        raise ValueError(f"--device {args.device}: the embedded model runs on the CPU only (specfit.embedded.load); "
                         f"leave --device out, or calibrate a checkpoint of your own with --model")
    check.cuda_device(args)
    check.output(args, "out", kind="file")
    check.output(args, "plot", kind="file")
    if not args.out:  # the profile (and the kept link, the plot beside it) goes to the user cache
        from ..selection.profile_files import cache_root

        check.writable(str(cache_root()), "the user cache ($SPECFIT_CACHE, where the profile goes without --out)")
    config = check.checkpoint_config(args.model) if args.model else json.loads((TARGET_DIR / "config.json").read_text())
    experts = check.experts_per_layer(config)
    if args.slots is not None and experts is not None and not 1 <= args.slots <= experts:
        raise ValueError(f"--slots must be in 1..{experts} (the model's experts per MoE layer), got {args.slots}")
    check.at_least(args, 1, "slots")
    if args.slots is None and experts is None:
        raise ValueError("cannot tell the model's experts per MoE layer from its config; pass --slots N")
    if args.drafter is not None:
        check.drafter_source(args.drafter)  # before the target loads: a typo is refused now, not after it
    if args.acceptance_only:
        drafter = args.drafter or (str(DRAFTER_DIR) if args.model is None else None)
        if not args.out and (drafter is None or not Path(drafter).is_dir()):
            raise ValueError("--acceptance-only files the tables in the user cache under a local drafter folder's "
                             "content; pass --drafter FOLDER (a local EAGLE-3 checkpoint folder) or --out PATH")
        return
    if args.prompts not in ("gsm8k", "cnn", "random"):
        if not args.prompts.endswith(".jsonl"):
            raise ValueError(f"--prompts must be gsm8k, cnn, random or a .jsonl file, got {args.prompts!r}")
        if not Path(args.prompts).is_file():
            raise ValueError(f"--prompts {args.prompts!r}: no such file (a .jsonl with a 'question' or 'text' field "
                             f"per line)")
    local = Path(args.model).expanduser() if args.model else None
    if args.prompts != "random" and local is not None and local.is_dir() and not check.has_tokenizer(local):
        raise ValueError(f"--prompts {args.prompts} needs the model's tokenizer, and {args.model} has none "
                         f"({', '.join(check.TOKENIZER_FILES)}); use --prompts random")


def main(args) -> int:
    if args.acceptance_only:
        return _acceptance_only(args)
    args.num_prompts = args.num_prompts or PROBES["num_prompts"]
    texts = _prompt_texts(args)  # the data first: without it there is nothing to time, so say so before loading
    import torch
    from tqdm.auto import tqdm

    from .probes import calibrate

    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu" or (args.device is None and not torch.cuda.is_available()):
        torch.set_num_threads(1)  # see --threads: the default that keeps the timer quiet on a shared CPU
    kept = ""
    try:
        if args.model is None or args.default_link:  # the structural default link is kept with the profile fitted here
            from ..embedded import link_store, recheck_default_link

            print(link_store.recheck_line(*recheck_default_link()), flush=True)
            kept = "; the default link measured again is kept"
        t0 = time.perf_counter()
        model, tokenizer = _load(args)
        # said before the probes' minutes
        print(f"loaded in {time.perf_counter() - t0:.1f} s: {model.specfit!r}", flush=True)
        if model.specfit.lane is not None and model.specfit.lane.real:  # measured at enable: a slow lane says so
            print(f"host lane: {model.specfit.host_seconds(1) * 1e3:.3f} ms per expert at 1 token, "
                  f"{model.specfit.host_seconds(32) * 1e3:.3f} ms at 32", flush=True)
        prompts = _prompt_ids(args, texts, tokenizer, model)
        with tqdm(desc="calibration (planning round, then timed rounds)", unit="generate") as bar:
            def progress(done, total):
                bar.total = total
                bar.n = done
                bar.refresh()

            result = calibrate(model, prompts, probes=args.probes, repeats=args.repeats, seed=args.seed,
                               max_new_tokens=args.max_new_tokens, bootstrap=args.bootstrap, progress=progress,
                               lanes=_probe_lanes(args, model), lane_seconds=args.lane_seconds)
    except KeyboardInterrupt:  # nothing half-fitted is installed: the profile in place (if any) stays as it was
        where = args.out or "the user cache's profile for this model"
        raise KeyboardInterrupt(f"before the fit: no profile installed ({where} unchanged){kept}") from None
    cost = result.cost
    from ..selection.profile_files import profile_path

    path = Path(args.out or profile_path(cost.meta["device"], cost.meta["model_key"]))
    print(describe(cost))
    written = install(cost, path, force=args.force)
    installed = written == path
    beside = str(path).removesuffix(".json") + ("" if installed else ".rejected") + ".png"
    if args.plot != "none":
        plot_fit(result, args.plot or beside)
    return 0 if installed else 3


def _acceptance_only(args) -> int:
    """``--acceptance-only``: fit the drafter's acceptance tables (see evaluation/acceptance_tables.py) and write them
    to the user cache under the drafter's key, where ``enable`` finds them first (selection/acceptance_cache.py), or
    to ``--out``. Nothing is written into the drafter's folder (for the embedded drafter: the installed package)."""
    from . import datasets

    texts = datasets.calibration_texts(args.num_prompts or ACCEPTANCE_PROMPTS)  # the data before torch and the model
    import torch
    from tqdm.auto import tqdm

    from .acceptance_tables import calibration_prompts, describe as describe_tables, fit_tables
    from ..selection.acceptance_cache import user_tables_path

    from .. import embedded

    drafter = args.drafter or (embedded.DRAFTER_DIR if args.model is None else None)
    out = Path(args.out) if args.out else user_tables_path(drafter)  # a local folder: see check_arguments
    if args.slots is None:  # all resident: labels are not timed
        args.slots = cli_checks.experts_per_layer(_config(args))
    if args.threads or args.model is None:  # the embedded model runs on the CPU, fastest on one thread
        torch.set_num_threads(args.threads or 1)
    model, tokenizer = _load(args)
    if args.threads is None and model.specfit.device.type == "cpu":
        torch.set_num_threads(1)
    if tokenizer is None:
        raise ValueError("--acceptance-only decodes text prompts and needs the model's tokenizer")
    prompts = calibration_prompts(tokenizer, len(texts), texts)
    with tqdm(total=2 * len(prompts), desc="acceptance labels (greedy, then sampling)", unit="prompt") as bar:
        tables = fit_tables(model, prompts, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            progress=lambda done: bar.update(done - bar.n))
    print(describe_tables(tables))
    out.parent.mkdir(parents=True, exist_ok=True)
    tables.save(out)
    if args.out:
        print(f"acceptance tables written to {out} (specfit.enable reads the user cache's tables, not --out; "
              f"without --out they go where it reads them first)")
    else:
        print(f"acceptance tables written to {out}: specfit.enable(..., drafter={str(drafter)!r}) loads them "
              f"first; the drafter folder's own acceptance.json is left as it was")
    return 0


def install(cost, path, force: bool = False, python: bool = False, command: str | None = None) -> Path:
    """Write the profile (a ``CostModel``) to ``path`` unless its fit is poor, in which case it goes to
    ``path + ".rejected"`` (a name neither ``enable()`` nor the reference lookup reads), a loud refusal with the
    remedy is printed, and whatever was at ``path`` stays. ``force`` installs a poor profile anyway (``enable()``
    warns when it loads it). Returns the path written. ``python``: called as ``specfit.calibrate(...)``, so the
    refusal speaks of its keyword arguments and is raised (``CalibrationRefused``), the forced install warns
    (``RuntimeWarning``), instead of printing the command's words. ``command``: calibrated by another command
    (``specfit bench``), the refusal names this calibration command (e.g. ```specfit calibrate --fp8```)."""
    from ..selection.fit_quality import REMEDY, REMEDY_PYTHON

    path = Path(path)
    quality = cost.quality or {}
    if quality.get("verdict") != "poor":
        cost.save(path)
        print(f"profile written to {path}")
        return path
    reasons = "".join(f"\n  - {reason}" for reason in quality.get("reasons", []))
    remedy, force_it = (REMEDY_PYTHON, "force=True") if python else (REMEDY, "--force")
    if force:
        cost.save(path)
        text = (f"the fit is unreliable and was installed anyway ({force_it}) at {path}:{reasons}\n"
                f"  SpecFit will warn whenever it loads it. Remedy: {remedy}.")
        if python:
            warnings.warn(text, RuntimeWarning, stacklevel=3)
        else:
            print(f"WARNING: {text}", file=sys.stderr)
        return path
    rejected = path.with_name(path.name + ".rejected")
    cost.save(rejected)
    again = ("call specfit.calibrate again with force=True" if python else
             f"run `{command.strip('`')} --force`" if command else "rerun with --force")
    remedy = f"calibrate with {command}: {remedy}" if command else remedy
    text = (f"CALIBRATION REFUSED: the fit is unreliable, so it was NOT installed at {path}:{reasons}\n"
            f"  Remedy: {remedy}.\n"
            f"  The rejected profile is at {rejected} for inspection; {again} to install it anyway.")
    if python:
        raise CalibrationRefused(text, cost, rejected)
    print(f"\n{text}\n", file=sys.stderr)
    return rejected


SLOT_SHARE = 48 / 128  # --slots by default: the paper's headline setting, 48 of Qwen3-30B-A3B's 128 experts per layer


def default_slots(config) -> int:
    """``SLOT_SHARE`` of the model's experts per layer (at least 1), read from its config (a transformers config
    or the dict of a ``config.json``)."""
    n = cli_checks.experts_per_layer(config if isinstance(config, dict) else config.to_dict())
    if n is None:
        raise ValueError("cannot tell the model's experts per layer from its config; pass --slots N")
    return max(1, round(n * SLOT_SHARE))


def _config(args) -> dict:
    """The model's ``config.json`` (checked readable by ``check_arguments``)."""
    from ..embedded.paths import TARGET_DIR

    return cli_checks.checkpoint_config(args.model) if args.model else json.loads((TARGET_DIR / "config.json")
                                                                                   .read_text())


def _probe_lanes(args, model):
    """The host lanes of the probes' host rounds: ``--host-ratio`` (0: none; R: the structural default host lane at
    R x the link), else the probes' default (``probes.probe_lanes``)."""
    from .. import embedded
    from .probes import probe_lanes, probe_links

    if args.host_ratio is None:
        return None
    if not (args.host_ratio >= 0 and args.host_ratio < float("inf")):
        raise ValueError(f"--host-ratio must be a finite number >= 0 (0: no host-lane rounds), got {args.host_ratio}")
    if args.host_ratio == 0:
        return []
    link = probe_links(model)[-1]
    if link is None or not embedded.is_embedded(model):
        raise ValueError("--host-ratio sets the embedded model's structural host lane beside an emulated link; this "
                         "run has no emulated link or is not the embedded model (give --host-ratio 0, or none)")
    return probe_lanes(model, embedded.default_host(args.host_ratio, link))


def _load(args):
    import torch

    from .. import embedded
    from ..offload.link import LinkConfig

    if args.slots is None:
        args.slots = default_slots(_config(args))
        print(f"--slots not given: {args.slots} slots per MoE layer (3/8 of the model's experts, as the paper's 48 of "
              f"128)", flush=True)
    if args.default_link is not None:
        link = embedded.default_link(args.default_link) if args.default_link > 0 else None
    else:
        link = LinkConfig(seconds_per_expert=args.link_ms / 1e3) if args.link_ms else None
    kw = dict(cache_mode=args.cache_mode, link=link)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.model is None:  # the profile is filed under the dtype computed in: --dtype gets one of its own
        model, tokenizer = embedded.load(args.slots, fp8=args.fp8, dtype=dtype, **kw)
        if args.drafter:
            from ..patch import set_drafter

            set_drafter(model, args.drafter)
        return model, tokenizer
    from ..patch import from_pretrained

    model = from_pretrained(args.model, cache_slots=args.slots, dtype=dtype, device=args.device,
                            drafter=args.drafter, **kw)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception:  # synthetic checkpoints ship no tokenizer
        tokenizer = None
    return model, tokenizer


def _prompt_texts(args) -> list[str] | None:
    """The prompts' text, read before the model loads (None for ``--prompts random``: token ids drawn later)."""
    from . import datasets

    if args.prompts == "random":
        return None
    if args.prompts in ("gsm8k", "cnn"):
        return datasets.prompts(args.prompts, args.num_prompts, max_chars=1500)
    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()]
    texts = [datasets.GSM8K_PROMPT.format(question=r["question"]) if "question" in r else r.get("text")
             for r in rows[: args.num_prompts]]
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"--prompts {args.prompts}: every line needs a 'question' or 'text' field (a non-empty "
                         f"string), and the file at least one line")
    return texts


def _prompt_ids(args, texts, tokenizer, model) -> list:
    import torch

    device = model.specfit.device
    if texts is None:  # --prompts random
        g = torch.Generator().manual_seed(args.seed)
        vocab = model.config.vocab_size
        return [torch.randint(1, vocab, (1, 32), generator=g).to(device) for _ in range(args.num_prompts)]
    if tokenizer is None:
        raise ValueError(f"--prompts {args.prompts} needs a tokenizer, and none was found with the model; "
                         f"use --prompts random")
    return [tokenizer(t, return_tensors="pt").input_ids.to(device) for t in texts]
