"""The ``specfit`` command. Each subcommand lives in its own module, imported only when it runs, so ``specfit --help``
stays fast; a subcommand module defines ``add_arguments(parser)``, ``check_arguments(args)`` and
``main(args) -> int | None``. A subcommand's module imports nothing heavy (no torch, no transformers) at its top, so
its ``--help`` and every refusal of its options come in a fraction of a second: ``check_arguments`` checks every
option (``specfit.cli_checks``) before ``main`` imports torch or loads a model.
"""

import argparse
import os
import sys
import textwrap
from importlib import import_module

DESCRIPTION = """\
SpecFit runs a large mixture-of-experts model on one GPU with its routed experts in host memory and a small cache
of expert slots per layer on the GPU, and speeds up decoding with tree speculative decoding that verifies only the
draft tokens worth the expert copies they cause. The output is the model's own: greedy decoding gives exactly the
tokens of plain generate().

In Python: specfit.from_pretrained(...) or specfit.enable(model, cache_slots=...), then
model.generate(..., assistant="specfit"). These commands run the embedded demo model shipped with the package,
measure this machine, and retrain the embedded models."""

# The terms the commands' output and the README use; README.md's glossary says the same.
TERMS = {
    "slots": "expert slots per MoE layer on the device: a cache of experts (the paper: 48 of Qwen3-30B-A3B's 128); "
             "a cache miss copies one expert from host memory",
    "cache policy": "which expert a miss evicts: 'forecast' (the default: decayed use frequency plus the experts "
                    "SpecFit's drafted tree is predicted to need), 'frequency', 'frequency-age' or 'lru'",
    "link": "the host-to-device path the experts are copied over; on a CPU it is emulated (each copy takes a set "
            "time) and every figure says so: CPU figures are not GPU speed",
    "cache mode": "'cached': slots keep experts across forwards (by the cache policy); 'cleared': emptied before "
                  "every forward",
    "AR": "autoregressive decoding: plain generate(), one token per forward",
    "drafter": "the small EAGLE-3 model that proposes a tree of draft tokens from the target's hidden states",
    "node": "one draft token of the tree; nodes/cycle counts the draft tokens verified per cycle",
    "cycle": "draft, select a subtree, verify it in one target forward, accept the longest agreeing path",
    "EAGLE-3": "drafts the full tree and verifies its 7 most probable nodes (the paper's baseline)",
    "eagle3-vanilla": "EAGLE-3 with the slot cache emptied before every forward (the paper's 'vanilla' row)",
    "SpecFit": "verifies the subtree with the most predicted tokens per predicted second, counting the experts it "
               "would copy, and stops drafting when deeper levels do not pay",
    "route source": "where SpecFit learns which experts a draft token would use: 'predictor' (trained), 'gate' "
                    "(the target's own routers on the drafter's states) or 'oracle'",
    "oracle": "exact routes from an extra target forward per drafted level: the paper's measurement device, not "
              "deployable; its time is counted and shown apart",
    "demand": "the experts a forward needs, summed over layers; copies are those not already in a slot",
    "profile": "the fitted cycle-time model a(n) + beta * demand + copy * misses that SpecFit's selector uses: one "
               "per machine and model (and the dtype it computes in), pricing every slot count, cache mode and link; "
               "`specfit calibrate` makes it",
}


def _glossary(width: int = 100) -> str:
    lines = ["terms:"]
    for term, text in TERMS.items():
        lines += textwrap.wrap(text, width, initial_indent=f"  {term:<16}", subsequent_indent=" " * 18,
                               break_on_hyphens=False)
    return "\n".join(lines) + "\n\nRun `specfit COMMAND --help` for a command's options. More: README.md."


GLOSSARY = _glossary()  # under `specfit --help` only
TERMS_POINTER = "The terms (slots, link, node, cycle, profile, ...) are explained once, under `specfit --help`."

# name -> (module, one-line help, description). Listed here so that `specfit --help` needs no heavy import.
SUBCOMMANDS = {
    "demo": ("specfit.evaluation.demo",
             "decode a few prompts with AR, EAGLE-3 and SpecFit on the embedded model and compare them",
             "Decode GSM8K and CNN/DailyMail prompts (or your own: --prompt TEXT) with the embedded model (a small "
             "Qwen3-MoE and its EAGLE-3 drafter, shipped with the package) three ways, AR, EAGLE-3 and SpecFit, on "
             "the CPU with an emulated host link and host lane, in specfit.embedded.demo_settings()'s configuration "
             "(the README's and the notebook's; the header says where flags change it). Prints the text once (all "
             "three write the same tokens), a table of tok/s, against AR and EAGLE-3, tokens per cycle and expert "
             "copies per token (--wide: every column of specfit.compare), and per workload the verdict: SpecFit "
             "against AR and EAGLE-3 with the prompt-to-prompt spread of this run, and its copies per token against "
             "EAGLE-3's. A few minutes on a CPU; without the datasets it uses built-in prompts. Ctrl-C prints the "
             "tables of the prompts finished."),
    "bench": ("specfit.evaluation.bench",
              "reproduce the paper's table on the embedded model (slot sweep, two link regimes)",
              "Reproduce the paper's table on the embedded model: AR, EAGLE-3 vanilla, EAGLE-3 and SpecFit (plus "
              "SpecFit with oracle routes) over a sweep of slot counts, with no link cost and with an emulated host "
              "link, on CNN/DailyMail and GSM8K test prompts. Writes results.json and a PNG of tok/s against slots. "
              "SpecFit uses this machine's cost profile for the model (one per machine and model, pricing every "
              "slot count, cache mode and link), else the reference profile shipped for the embedded model; a "
              "model with neither (the FP8 variant) is calibrated first. --quick is a smoke run."),
    "calibrate": ("specfit.evaluation.calibrate",
                  "fit this machine's cost profile for a model (once per machine and model), check it, install it",
                  "Fit the cycle-time model time = a(n) + beta * demand + copy * misses on this machine for one model "
                  "(in the dtype it computes in: --dtype), from timed probe cycles: a(n) per verified node count n, "
                  "beta per expert computed, and per expert copied an overhead plus a share of the link's own time. "
                  "One profile per machine and model prices every slot count, cache mode and link, since those change "
                  "only how often an expert misses and what the link takes per copy. Checks the fit (held-out error, "
                  "bootstrap intervals, the selector's stability) and installs the profile in the user cache, where "
                  "specfit.enable finds it. A poor fit is refused with the remedy (--force installs it anyway). A few "
                  "minutes on a CPU with the defaults; every option is checked before anything loads."),
    "estimate": ("specfit.evaluation.estimate",
                 "print the tok/s each method should reach, from the cost profile, before any decoding",
                 "Estimate the decode tok/s of AR, EAGLE-3 and SpecFit on the embedded model from the calibrated cost "
                 "profile (this machine's, else the reference shipped with specfit) and the drafter's acceptance "
                 "tables, without loading or running the model: a cycle's time a(n) + beta * demand + miss * cold, "
                 "its tokens 1 + the path values it verifies, under uniform routing (hit rate slots / experts unless "
                 "--hit-rate). The demo's configuration by default. Then `specfit demo` measures them."),
    "make-fp8": ("specfit.embedded.fp8", "write the embedded model's block-wise FP8 variant to a folder",
                 "Quantize the embedded target's projections to e4m3 with a float32 weight_scale_inv per 8x16 block "
                 "(the hub's FP8 layout; router, norms and embeddings stay bf16). `specfit demo --fp8` and "
                 "`specfit bench --fp8` build the same variant into the user cache themselves."),
    "serve": ("specfit.serving.command", "serve the model with SpecFit behind an OpenAI-compatible server",
              "Serve the model (default: the embedded one) with its experts offloaded and SpecFit decoding behind "
              "transformers' own OpenAI-compatible server (transformers serve): /v1/chat/completions and "
              "/v1/completions, streaming or not, /v1/models, and each request's SpecFit counters at "
              "/v1/specfit/stats/ID. Requests are served one at a time in arrival order; more than --max-queue "
              "waiting get 429. Needs the serve extra: pip install 'specfit[serve]'. docs/serve.md says more."),
    "export": ("specfit.export.command",
               "write a model folder that stock transformers runs with SpecFit (custom_generate)",
               "Write a model folder (the target's weights, hard-linked where possible, else copied; the drafter; the "
               "tokenizer; custom_generate/generate.py and SpecFit's settings) that stock transformers runs with "
               "SpecFit: AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True).generate(...) enables "
               "SpecFit on the loaded model at its first call, and `transformers serve OUT --trust-remote-code` "
               "serves it; without trust_remote_code the model is plain. Nothing is loaded: every option is checked "
               "from the folders' files. docs/export.md says more, and how to push the folder to the Hub."),
    "train-target": ("specfit.training.target", "train the embedded Qwen3-MoE (and its tokenizer) from scratch",
                     "Train the embedded Qwen3-MoE and its tokenizer from scratch on GSM8K and OpenStax text "
                     "(needs the local data folder)."),
    "train-drafter": ("specfit.training.drafter", "train the embedded EAGLE-3 drafter on target-generated text",
                      "Train the embedded EAGLE-3 drafter on responses the target generates."),
    "train-router": ("specfit.training.router_command", "train the route predictor for draft nodes",
                     "Train the route predictor that tells SpecFit which experts a draft token will use (saved "
                     "beside the drafter, where route_source='auto' finds it)."),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; every option's default shown unless its help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as installed

    from . import __version__

    parts = []
    for name in ("torch", "transformers"):
        try:
            parts.append(f"{name} {installed(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} missing")
    return f"specfit {__version__} (Python {sys.version.split()[0]}, {', '.join(parts)})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfit", description=DESCRIPTION, epilog=GLOSSARY,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text, _) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str) -> argparse.ArgumentParser:
    module_name, _, description = SUBCOMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"specfit {name}", description=textwrap.fill(description, 100),
                                     epilog=TERMS_POINTER, formatter_class=HelpFormatter)
    import_module(module_name).add_arguments(parser)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser = build_parser()
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown command {argv[0]!r}; choose one of: {', '.join(SUBCOMMANDS)}")
        parser.parse_args(argv)  # prints help for -h, the version for --version, errors for other flags
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    args = command_parser(name).parse_args(argv[1:])
    from .evaluation.datasets import DataUnavailable  # light: no torch

    module = import_module(SUBCOMMANDS[name][0])
    try:
        module.check_arguments(args)  # every option, before main imports torch or loads anything
        return int(module.main(args) or 0)
    except (ValueError, FileNotFoundError, DataUnavailable) as err:  # refusals: what and why, without a traceback
        if os.environ.get("SPECFIT_TRACEBACK"):
            raise
        print(f"specfit {name}: error: {err}\n(set SPECFIT_TRACEBACK=1 to see where)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C: the command kept what it had done and says what, in its message
        return interrupted(name, err)


def interrupted(name: str, err: KeyboardInterrupt) -> int:
    """Ctrl-C in a command: one line on stderr (what the command kept, when it said so), no traceback (unless
    ``SPECFIT_TRACEBACK``), and the shell's exit status for SIGINT."""
    if os.environ.get("SPECFIT_TRACEBACK"):
        raise err
    said = " ".join(str(err).split())
    print(f"\nspecfit {name}: interrupted (Ctrl-C){': ' + said if said else ''}", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
