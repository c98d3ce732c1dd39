"""SpecFit's decoding for this model folder, written by `specfit export`.

transformers runs this file's ``generate`` in place of the model's own when the folder is loaded with
``trust_remote_code=True``: the routed experts move to host memory with a small slot cache on the model's device at
the first call, and decoding runs SpecFit's tree speculation with the drafter in ``drafter/``. The settings are in
``custom_generate/specfit.json``. Needs ``pip install specfit`` (named in ``requirements.txt``).
"""

from specfit.export import runtime


def generate(*args, model, **kwargs):
    """``model.generate(...)`` with SpecFit; takes every argument transformers' ``generate()`` takes (and
    ``assistant=``: ``None`` for plain decoding)."""
    return runtime.generate(*args, model=model, **kwargs)
