"""``specfit serve``: the model loaded and enabled by SpecFit (offloaded experts, slot cache, drafter) behind
transformers' OpenAI-compatible server (``specfit.serving``). Options are checked before torch is imported."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import cli_checks
from .server import DEFAULT_MAX_BATCH

ASSISTANT_CHOICES = ("specfit", "eagle3", "none")


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the embedded model)")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the embedded drafter)")
    p.add_argument("--slots", type=int, default=None,
                   help="expert slots per MoE layer (default: 3/8 of the model's experts, as the paper's 48 of 128)")
    p.add_argument("--cold", choices=("copy", "host", "auto"), default=None,
                   help="where experts that miss the slots are computed (default: 'auto' with a host lane, else "
                        "'copy'; see specfit.enable)")
    p.add_argument("--link-ms", type=float, default=None,
                   help="emulated ms per expert copy, CPU only (default for the embedded model: the structural "
                        "default link, as `specfit demo`; 0: none)")
    p.add_argument("--assistant", choices=ASSISTANT_CHOICES, default="specfit",
                   help="decoding of requests that do not name one ('none': plain decoding)")
    p.add_argument("--depth", type=int, default=None, help="deepest draft level (decoding option)")
    p.add_argument("--max-nodes", type=int, default=None, help="draft nodes verified per cycle at most")
    p.add_argument("--topk", type=int, default=None, help="children per expanded draft node")
    p.add_argument("--name", default="specfit", help="the model name clients send and /v1/models lists")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests running or waiting at once; more are answered 429")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help="non-streaming requests with equal settings that wait together run as one batch of up to "
                        "N rows (1: each request alone)")
    p.add_argument("--host", default="localhost", help="server listen address")
    p.add_argument("--port", type=int, default=8000, help="server listen port")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, the host lane's included (default: 1 for the embedded model, which runs "
                        "on the CPU and is fastest on one; for any other model, as when it runs on an accelerator, "
                        "every core the machine gives this process)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (uvicorn and transformers)")


def check_arguments(args) -> None:
    """Every option, before torch is imported: a refusal names the value and what would be right."""
    from importlib.util import find_spec

    from ..embedded.paths import TARGET_DIR

    missing = [name for name in ("fastapi", "uvicorn", "openai", "pydantic") if find_spec(name) is None]
    if missing:
        raise ValueError(f"specfit serve needs {', '.join(missing)} (transformers' serving stack): "
                         f"pip install 'specfit[serve]'")
    cli_checks.at_least(args, 1, "slots", "max_queue", "max_batch", "threads", "depth", "max_nodes", "topk")
    cli_checks.milliseconds(args, "link_ms")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    config = cli_checks.checkpoint_config(args.model) if args.model else json.loads(
        (TARGET_DIR / "config.json").read_text())
    experts = cli_checks.experts_per_layer(config)
    if args.slots is not None and experts is not None and args.slots > experts:
        raise ValueError(f"--slots must be in 1..{experts} (the model's experts per MoE layer), got {args.slots}")
    if experts is None:  # a dense model: nothing to offload (refused as the Python API refuses it)
        cli_checks.moe_config(config, args.model, "--model")
    if args.drafter is not None:
        if Path(args.drafter).expanduser().exists():
            cli_checks.drafter_source(args.drafter)  # config.json and weights, before the model loads
        elif not cli_checks.HUB_ID.match(args.drafter):
            raise ValueError(f"--drafter {args.drafter!r} is neither a local EAGLE-3 checkpoint folder (no such "
                             f"path) nor a hub id (owner/name)")
    if args.model is not None and args.drafter is None and args.assistant != "none":
        raise ValueError(f"--assistant {args.assistant} needs a drafter for --model {args.model}: pass --drafter "
                         f"FOLDER, or --assistant none")
    if args.link_ms is not None and not math.isfinite(args.link_ms):
        raise ValueError(f"--link-ms must be finite, got {args.link_ms}")


def load(args):
    """(model, tokenizer) enabled by SpecFit as the options say."""
    import torch

    from .. import embedded
    from ..evaluation.calibrate import default_slots
    from ..offload.link import LinkConfig

    decoding = {k: getattr(args, k) for k in ("depth", "max_nodes", "topk") if getattr(args, k) is not None}
    kw = dict(decoding, **({"cold": args.cold} if args.cold else {}))
    if args.model is None:
        slots = args.slots or default_slots(json.loads((embedded.TARGET_DIR / "config.json").read_text()))
        link = embedded.default_link() if args.link_ms is None else (
            LinkConfig(seconds_per_expert=args.link_ms / 1e3) if args.link_ms > 0 else None)
        model, tokenizer = embedded.load(slots, link=link, **kw)
        if args.drafter:
            from ..patch import set_drafter

            set_drafter(model, args.drafter)
        return model, tokenizer
    from transformers import AutoConfig, AutoTokenizer

    from ..patch import from_pretrained

    slots = args.slots or default_slots(AutoConfig.from_pretrained(args.model))
    link = LinkConfig(seconds_per_expert=args.link_ms / 1e3) if args.link_ms else None
    model = from_pretrained(args.model, cache_slots=slots, drafter=args.drafter, link=link, **kw)
    return model, AutoTokenizer.from_pretrained(args.model)


def default_threads(embedded_model: bool, cores: int) -> int:
    """``--threads`` unless given: 1 for the embedded model, which runs on the CPU and is fastest on one (its
    matrices are so small that more threads only add synchronisation); every core the machine gives this process for
    any other model (on an accelerator its host lane computes cold experts on these threads).

    >>> default_threads(True, 16), default_threads(False, 16)
    (1, 16)
    """
    return 1 if embedded_model else max(1, cores)


def machine_cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def main(args) -> int:
    import torch

    from .server import serve

    threads = args.threads if args.threads is not None else default_threads(args.model is None, machine_cores())
    torch.set_num_threads(threads)  # before loading: the embedded model's default link is measured at this count
    try:
        model, tokenizer = load(args)
    except KeyboardInterrupt:
        print("specfit serve: stopped while loading", flush=True)
        return 130
    assistant = None if args.assistant == "none" else args.assistant
    shown = "localhost" if args.host in ("localhost", "127.0.0.1") else args.host
    print(f"specfit serve: {args.name!r} on http://{shown}:{args.port}/v1 (OpenAI-compatible; requests decoded "
          f"with assistant={assistant!r} unless they ask otherwise; non-streaming requests that wait together "
          f"share calls of up to {args.max_batch}; torch CPU threads: {threads}; Ctrl-C stops)", flush=True)
    serve(model, tokenizer, host=args.host, port=args.port, name=args.name, max_queue=args.max_queue,
          assistant=assistant, log_level=args.log_level, max_batch=args.max_batch)
    print("specfit serve: stopped", flush=True)
    return 0
