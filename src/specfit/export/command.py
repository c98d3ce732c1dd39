"""``specfit export OUT``: a model folder that stock transformers runs with SpecFit (``writer.py``). Nothing heavy is
imported and no weight is read: every option is checked from the folders' files (``check_arguments``), then files
are linked or copied."""

from __future__ import annotations

import json
from pathlib import Path

from .. import cli_checks
from ..offload.cold import COLD_MODES
from ..offload.policies import DEFAULT as DEFAULT_POLICY, POLICIES
from .settings import ASSISTANTS, DECODING, SETTINGS_FILE

WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
DRAFTER_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def add_arguments(p) -> None:
    p.add_argument("out", metavar="OUT", help="the folder to write (new, or empty)")
    p.add_argument("--model", default=None,
                   help="the target's checkpoint folder, with its tokenizer (default: the embedded model)")
    p.add_argument("--drafter", default=None,
                   help="EAGLE-3 drafter folder (default: the embedded drafter, for the embedded model)")
    p.add_argument("--base-model", default=None,
                   help="the Hub id of the model in --model, named as base_model in the folder's card")
    p.add_argument("--slots", type=int, default=None,
                   help="expert slots per MoE layer (default: 3/8 of the model's experts, as the paper's 48 of 128)")
    p.add_argument("--cache-mode", choices=("cached", "cleared"), default="cached",
                   help="'cached': slots keep experts across forwards; 'cleared': emptied before every forward")
    p.add_argument("--cache-policy", choices=tuple(POLICIES), default=DEFAULT_POLICY,
                   help="which expert a miss evicts")
    p.add_argument("--cold", choices=COLD_MODES, default=None,
                   help="where experts that miss the slots are computed (default: 'auto' on CUDA, 'copy' on a CPU; "
                        "'host' and 'auto' need CUDA)")
    p.add_argument("--link-ms", type=float, default=None,
                   help="an emulated host link's ms per expert copy, for CPU studies (default: none; refused on "
                        "CUDA, where copies are real)")
    p.add_argument("--assistant", choices=ASSISTANTS, default="specfit",
                   help="what generate() decodes with unless a call names one ('none': plain decoding)")
    p.add_argument("--depth", type=int, default=None, help="deepest draft level (decoding option)")
    p.add_argument("--max-nodes", type=int, default=None, help="draft nodes verified per cycle at most")
    p.add_argument("--topk", type=int, default=None, help="children per expanded draft node")


def check_arguments(args) -> None:
    """Every option, before anything is written (no weight is ever loaded): a refusal names the value and the
    remedy."""
    cli_checks.empty_output(args.out, "OUT")
    cli_checks.at_least(args, 1, "slots", "depth", "topk")
    cli_checks.at_least(args, 0, "max_nodes")
    cli_checks.milliseconds(args, "link_ms")
    model = model_folder(args)
    experts = cli_checks.moe_config(json.loads((model / "config.json").read_text()), args.model or str(model),
                                    "--model")
    if args.slots is not None and args.slots > experts:
        raise ValueError(f"--slots must be in 1..{experts} (the model's experts per MoE layer), got {args.slots}")
    if args.model is not None and args.drafter is None and args.assistant != "none":
        raise ValueError(f"--assistant {args.assistant} needs a drafter for --model {args.model}: pass --drafter "
                         f"FOLDER (an EAGLE-3 drafter of this model), or --assistant none")
    if args.drafter is not None:
        drafter_folder(args.drafter)
    if args.base_model is not None and not cli_checks.HUB_ID.match(args.base_model):
        raise ValueError(f"--base-model {args.base_model!r} is not a Hub model id (owner/name, e.g. "
                         f"Qwen/Qwen3-30B-A3B)")
    if args.cold in ("host", "auto") and args.link_ms:
        raise ValueError(f"--cold {args.cold} needs CUDA (the host CPU computes the experts there) and --link-ms "
                         f"emulates a link on a CPU: the folder could run on neither; drop one of them")


def model_folder(args) -> Path:
    """--model's folder (default: the embedded target): a checkpoint folder with config.json, weights and a
    tokenizer."""
    from ..embedded.paths import TARGET_DIR

    if args.model is None:
        return TARGET_DIR
    path = Path(args.model).expanduser()
    if not path.exists() and cli_checks.HUB_ID.match(args.model):
        raise ValueError(f"--model {args.model!r} is no local folder; export takes a checkpoint folder: download "
                         f"the Hub model first (`hf download {args.model} --local-dir DIR`), then --model DIR "
                         f"--base-model {args.model}")
    path = cli_checks.folder(args.model, "--model", must_hold="config.json")
    if not any((path / name).is_file() for name in WEIGHT_NAMES):
        raise ValueError(f"--model {args.model!r} holds no weights ({', '.join(WEIGHT_NAMES[::2])}): give the "
                         f"checkpoint folder itself")
    if not cli_checks.has_tokenizer(path):
        raise ValueError(f"--model {args.model!r} holds no tokenizer (tokenizer.json, tokenizer_config.json, ...): "
                         f"the exported folder carries the target's tokenizer for transformers serve; save it there "
                         f"first (AutoTokenizer.from_pretrained(ID).save_pretrained({args.model!r}))")
    return path


def drafter_folder(value: str) -> Path:
    path = Path(value).expanduser()
    if not path.exists():
        raise ValueError(f"--drafter {value!r}: no such folder; give the EAGLE-3 drafter's checkpoint folder "
                         f"(config.json and model.safetensors), or --assistant none for no drafter")
    path = cli_checks.folder(value, "--drafter", must_hold="config.json")
    if not any((path / name).is_file() for name in DRAFTER_WEIGHTS):
        raise ValueError(f"--drafter {value!r} holds no weights ({', '.join(DRAFTER_WEIGHTS)}): give the EAGLE-3 "
                         f"drafter's checkpoint folder")
    return path


def main(args) -> int:
    from ..embedded import DRAFTER_DIR, MODEL_ID
    from ..evaluation.calibrate import default_slots
    from .settings import build
    from .writer import export_folder, summary

    model = model_folder(args)
    embedded = args.model is None
    drafter = Path(args.drafter) if args.drafter else (DRAFTER_DIR if embedded else None)
    config = json.loads((model / "config.json").read_text())
    settings = build(cache_slots=args.slots or default_slots(config), cache_mode=args.cache_mode,
                     cache_policy=args.cache_policy, cold=args.cold, link_ms=args.link_ms, assistant=args.assistant,
                     drafter=drafter is not None, decoding={k: getattr(args, k) for k in DECODING},
                     embedded=embedded, source=MODEL_ID if embedded else (args.base_model or model.name),
                     base_model=args.base_model)
    out = Path(args.out).expanduser()
    written = export_folder(out, model, drafter, settings)
    print(f"specfit export: wrote {out} ({len(written)} files of {'the embedded model' if embedded else model}"
          f"{f' and its drafter' if drafter else ''}; SpecFit settings in {SETTINGS_FILE}: "
          f"{settings['cache_slots']} slots, assistant {settings['assistant']!r})")
    print("\n".join(summary(written)))
    print(f"Load it with SpecFit:  AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
          f"plain (no SpecFit):    AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
          f"serve it:              transformers serve {out} --trust-remote-code\n"
          f"docs/export.md says how to push it to the Hub.")
    return 0
