"""What a user names works after a plain ``import specfit``: every registered assistant on an enabled model (the
acceptance oracle too, registered by the generate() strategy's import of it), and ``specfit --help``'s glossary names the cache policy that is the default."""

import os
import subprocess
import sys

import pytest

from specfit import cli, embedded
from specfit.offload import policies

needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")

FRESH = """
import torch, specfit
from specfit import embedded
torch.set_num_threads(1)
model, tokenizer = embedded.load(cache_slots=16)
assert "acceptance-oracle" in specfit.ASSISTANTS, sorted(specfit.ASSISTANTS)
ids = tokenizer("Question: What is 2 + 3?\\nAnswer:", return_tensors="pt").input_ids
plain = model.generate(ids, max_new_tokens=6, do_sample=False)
for name in sorted(specfit.ASSISTANTS):
    out = model.generate(ids, max_new_tokens=6, do_sample=False, assistant=name)
    assert out.tolist() == plain.tolist(), name
    print(name, model.specfit.stats.last_method)
"""


@needs_embedded
def test_every_registered_assistant_runs_by_name_in_a_fresh_process():
    """A fresh interpreter: nothing but ``import specfit`` ran before the names are used (the tests' own process
    has imported the evaluation modules that used to register the oracle)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "acceptance-oracle acceptance-oracle" in out.stdout.splitlines()


def test_the_help_glossary_names_the_default_cache_policy():
    assert policies.DEFAULT == "forecast"
    glossary = " ".join(cli.GLOSSARY.split())
    assert f"'{policies.DEFAULT}' (the default" in glossary
    assert "LRU" not in glossary  # the slot cache is not an LRU cache by default
    assert all(f"'{name}'" in glossary for name in policies.POLICIES)
