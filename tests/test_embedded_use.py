"""The embedded model from a notebook: ``specfit.embedded`` after a plain ``import specfit``, and a one-time notice
when torch's thread count would slow it (advised, never changed inside a library call)."""

import subprocess
import sys
import warnings

import pytest
import torch

from specfit import embedded

needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")


def test_specfit_embedded_after_a_plain_import():
    code = "import specfit; print(specfit.embedded.load.__name__, 'embedded' in dir(specfit))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["load", "True"]


def test_threads_notice_once_when_the_count_would_slow_it(monkeypatch):
    monkeypatch.setattr(embedded, "_threads_noticed", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        embedded.advise_threads(embedded.FASTEST_THREADS)
        assert caught == []
        embedded.advise_threads(8)
        embedded.advise_threads(8)
    assert len(caught) == 1 and caught[0].category is embedded.ThreadsNotice
    message = str(caught[0].message)
    assert "8 CPU threads" in message and "torch.set_num_threads(1)" in message


@needs_embedded
def test_load_gives_the_notice_and_changes_no_setting(monkeypatch):
    monkeypatch.setattr(embedded, "_threads_noticed", False)
    torch.set_num_threads(2)
    try:
        with pytest.warns(embedded.ThreadsNotice, match="2 CPU threads"):
            embedded.load(8)
        assert torch.get_num_threads() == 2  # advised, never changed inside a library call
    finally:
        torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", embedded.ThreadsNotice)
        embedded.load(8)  # one thread: no notice
