import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(1)  # tiny models: one thread is fastest, and immune to a busy second core


# The suite runs with a cache of its own: what a test keeps (the default link's measurement, profiles, acceptance
# tables, the FP8 variant) goes to a temporary folder made once per run, by the first process (pytest itself, or
# the xdist controller before it starts its workers, which inherit the environment), and removed at its end. The
# user's cache (the SPECFIT_CACHE this run was started with, else the platform's folder) and the data folders are
# watched: a test after which a file appeared or changed there fails (``_user_folders_untouched``).
def _user_cache() -> Path:
    if os.environ.get("SPECFIT_CACHE"):
        return Path(os.environ["SPECFIT_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("specfit", appauthor=False))


FIRST_PROCESS = "SPECFIT_TESTS_USER_CACHE" not in os.environ  # pytest itself, or the xdist controller
if FIRST_PROCESS:
    os.environ["SPECFIT_TESTS_USER_CACHE"] = str(_user_cache())
    os.environ["SPECFIT_CACHE"] = tempfile.mkdtemp(prefix="specfit-tests-cache-")
    atexit.register(shutil.rmtree, os.environ["SPECFIT_CACHE"], ignore_errors=True)
SESSION_CACHE = Path(os.environ["SPECFIT_CACHE"])


def watched_folders() -> list[Path]:
    """The user's cache and the data folder the package reads (``$SPECFIT_DATA_DIR``, else ``shared/data``), as
    they were when the run started."""
    from specfit.evaluation import datasets

    data = datasets.data_dir()
    return [Path(os.environ["SPECFIT_TESTS_USER_CACHE"])] + ([Path(data)] if data is not None else [])


def snapshot(folders) -> dict:
    """Every file under ``folders``: its size and modification time."""
    seen = {}
    for folder in folders:
        for root, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(root, name)
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                seen[path] = (info.st_size, info.st_mtime_ns)
    return seen


def written(before: dict, after: dict) -> list[str]:
    """Files that appeared or changed between two snapshots."""
    return sorted(path for path, stamp in after.items() if before.get(path) != stamp)


WATCHED = watched_folders()
AT_START = snapshot(WATCHED)


@pytest.fixture(autouse=True)
def _user_folders_untouched():
    before = snapshot(WATCHED)
    yield
    changed = written(before, snapshot(WATCHED))
    if changed:
        pytest.fail(f"this test wrote into the user's cache or data folders ({', '.join(changed[:5])}): tests keep "
                    f"what they write in the run's own cache ({SESSION_CACHE}) or in tmp_path", pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    """The whole run, collection and workers included: nothing new in the user's cache or data folders."""
    changed = written(AT_START, snapshot(WATCHED)) if FIRST_PROCESS else []
    if changed:
        print(f"\nthe test run wrote into the user's cache or data folders: {', '.join(changed[:5])}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def tiny_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, intermediate_size=128,
              norm_topk_prob=True, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def tiny_moe(seed: int = 0, **overrides):
    """A tiny random Qwen3-MoE in fp32 (16 experts, top-4), built in code."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(**overrides)).eval()
    # random init gives near-uniform routers; sharpen them so routes differ between tokens
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(8.0)
    return model


@pytest.fixture
def model():
    return tiny_moe()


@pytest.fixture(scope="module")
def standin_embedded():
    """(model, tokenizer): the embedded model and drafter enabled under the CUDA stand-in, on its device (distinct
    from the host: ``specfit.offload.standin_device``), one thread."""
    from specfit import embedded
    from specfit.offload import standin, standin_device

    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(standin.ENV, "1")
        model, tokenizer = embedded.load(32)
    assert standin_device.is_device(model.device) and model.specfit.cuda
    return model, tokenizer


class SelfDrafter(torch.nn.Module):
    """A test double with the Eagle3Drafter interface that drafts with a copy of the target itself: its draft
    probabilities are the target's own, so its top-1 token is the target's greedy token. With ``noise`` > 0 a node's
    prediction is replaced by random logits with that probability, which makes acceptance partial. ``sharpen``
    multiplies the copy's logits, making its draft probabilities more confident.

    The drafter protocol never shows it token 0 of the prompt (pairs are (feature of t_i, t_{i+1})), so the copy is
    told it up front: ``first_token``.
    """

    def __init__(self, target, first_token: int, noise: float = 0.0, seed: int = 0, sharpen: float = 1.0):
        super().__init__()
        import copy
        from types import SimpleNamespace

        from transformers import DynamicCache

        self.target = copy.deepcopy(target).eval()
        self.first_token, self.noise, self.sharpen = first_token, noise, sharpen
        self.generator = torch.Generator().manual_seed(seed)
        self.config = SimpleNamespace(aux_layer_ids=(0, 1, 2), hidden_size=target.config.hidden_size)
        self.fc = torch.nn.Linear(1, 1)
        self.embed_tokens = None
        self.kv = DynamicCache(config=self.target.config)

    def set_embedding(self, embedding):
        pass

    def to_target_ids(self, draft_ids):
        return draft_ids

    def forward(self, input_ids, hidden, position_ids, cache=None, attention_mask=None):
        n = len(cache)
        extra = self.kv.get_seq_length() - (n + 1)
        if extra > 0:
            self.kv.crop(-extra)
        device = input_ids.device  # the target's (a GPU, or the CUDA stand-in's device)
        if n == 0 and self.kv.get_seq_length() == 0:
            self.target(torch.tensor([[self.first_token]], device=device), cache=self.kv, use_cache=True)
        if attention_mask is not None:  # the copy's KV has token 0 in front of the drafter's entries
            attention_mask = torch.cat([torch.zeros_like(attention_mask[..., :1]), attention_mask], dim=-1)
        with torch.no_grad():
            logits = self.target(input_ids, cache=self.kv, position_ids=position_ids + 1,
                                 attention_mask=attention_mask, use_cache=True).logits * self.sharpen
        if self.noise:  # drawn on the host (the same draws on any device), then moved
            flip = torch.rand(logits.shape[:2], generator=self.generator) < self.noise
            noise = torch.randn(logits.shape, generator=self.generator) * 3
            logits = torch.where(flip[..., None].to(device), noise.to(device), logits)
        T = input_ids.shape[1]
        cache.append(torch.zeros(1, 1, T, 1, device=device), torch.zeros(1, 1, T, 1, device=device))
        return logits, torch.zeros(1, T, self.config.hidden_size, device=device)


@pytest.fixture
def no_work(monkeypatch):
    """Each command's main fails the test: the refusal must come from its checks."""
    from importlib import import_module

    from specfit import cli

    for module, _, _ in cli.SUBCOMMANDS.values():
        def work(args, module=module):
            raise AssertionError(f"{module}.main ran: the refusal came after the work")
        monkeypatch.setattr(import_module(module), "main", work)
