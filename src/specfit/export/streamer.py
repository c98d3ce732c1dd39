"""A streamer's view of a multi-token put. SpecFit commits several tokens per cycle and puts them as one ``[1, n]``
tensor, as transformers' own assisted decoding does; the streamers of stock ``transformers serve`` take every put
as a list of token ids and count ``value.tolist()``: a ``[1, n]`` put counts as one token (5.25's ``_TokenStreamer``
sends it as one nested id; 5.24's ``DirectStreamer`` counts it once), so a streamed reply's ``usage`` and
``finish_reason`` would go wrong. A one-row put reaches the streamer flattened, ``[n]``, which every streamer reads
as n tokens (``TextStreamer`` takes both shapes)."""

from __future__ import annotations


class TokenByToken:
    """Wraps a streamer: a one-row 2-D put (``[1, n]``) is passed on as ``[n]``; anything else as it is."""

    def __init__(self, streamer):
        self.streamer = streamer

    def put(self, value) -> None:
        if getattr(value, "dim", None) is not None and value.dim() == 2 and value.shape[0] == 1:
            value = value.reshape(-1)  # [1, n] -> [n]
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()

    def __getattr__(self, name):  # anything else a caller reads of its streamer (e.g. a cancel flag)
        return getattr(self.streamer, name)
