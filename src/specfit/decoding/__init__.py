"""Stage 4, decoding: the decoding loop, acceptance, the assistants registry, the options, and the ``generate()``
strategy that hands ``generate(..., assistant=...)`` to the loop. Depends on the stages below it."""
