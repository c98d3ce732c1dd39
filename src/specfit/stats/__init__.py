"""Counters: one dataclass for everything SpecFit counts, read as ``model.specfit.stats``.

``Counters`` holds raw, additive counts; rates are derived properties, computed when read. ``Stats`` keeps several
``Counters``, and their names say which span each covers:

- ``stats.last_generate``: **the last** ``generate()`` **call** only (its decode phase, with the call's prefill
  seconds riding along), replaced by every call. This is what to read after a call.
- ``stats.total``: **the running sum** of every forward and call since ``stats.reset()`` (or since ``enable``).
- ``stats.last_prefill`` (the last call's prompt forward) and ``stats.last_forward`` (the last target forward).
  The prompt's forward is in ``last_prefill`` only, never in ``last_generate``: the two add up to the call's share of
  ``total``, and under SpecFit's loop or plain decoding ``last_generate.forwards`` equals its ``cycles``.
- ``stats.last_method``: the decoding path the last call ran: ``"ar"`` (transformers' own greedy or sampling
  decoding, no assistant); ``"specfit"``, ``"eagle3"`` or another registered assistant's name (SpecFit's loop);
  ``"assisted"`` (``assistant_model=``, ...) or ``"prompt_lookup"`` (``prompt_lookup_num_tokens=``): transformers'
  linear speculative decoding, other transformers modes by their ``GenerationMode`` value (``"beam_search"``, ...),
  where SpecFit sees only the target's forwards (expert counters, ``new_tokens`` and the times are the call's;
  ``cycles`` and ``tokens_committed`` stay 0); ``None``: no call yet, or the last one failed or was refused (its
  figures are then all zero). Every ``generate()`` on an enabled model clears the previous call's figures first.

In a notebook ``stats`` shows as a table of both (``_repr_html_``), and ``repr`` gives the same figures rounded on two
labelled lines. ``stats.start_trace()`` records one ``CycleRecord`` per decoding cycle from then on, exportable as
rows of dicts, a pandas DataFrame, or a plot (see ``Trace``).

Times are wall clock: ``prefill_seconds`` runs from the entry of ``generate()`` to the end of the prompt's forward,
``decode_seconds`` from there to the end of decoding, so together they are what a stopwatch around the call reads.
Measurement-only work done inside the call (the route oracle's extra forwards, the acceptance oracle's look-ahead)
is *included* in them and also shown on its own, as ``measurement_seconds``.

Copies are counted where they were issued: a forward's demand copies (bytes and copy-path time) in that forward's
counters, read when it ends; prefetch copies (issued between forwards) in ``total``, bytes when issued and time when
they have landed, at the latest when the ``generate()`` call ends. So ``bytes_copied / copy_busy_seconds`` is the
bandwidth of the same copies in every scope.
"

The package's rooms: ``counters`` (the ``Counters`` dataclass and its rates), ``scope`` (``Stats``, the spans of an
enabled model, and ``GenerateScope``, the accounting of one call), ``trace`` (``CycleRecord`` and its exports) and
``display`` (the figures a reader sees: repr, the notebook table).
"""

from .counters import Counters
from .scope import GenerateScope, Stats
from .trace import CycleRecord, Trace, plot_trace, trace_rows, trace_to_pandas

__all__ = ["Counters", "Stats", "GenerateScope", "CycleRecord", "Trace", "trace_rows", "trace_to_pandas", "plot_trace"]
