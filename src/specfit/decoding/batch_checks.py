"""What a batch must be before assistant decoding starts on it: left-padded rows with an attention mask that matches
them. Every check runs before any forward, and its error names the bad value and what would be right."""

from __future__ import annotations

import torch

from .loop import call_config


def check_batch_arguments(model, named: dict) -> None:
    """``named``: generate()'s arguments by name (``loop.generate_arguments``). Does nothing for one row."""
    ids = named.get("inputs") if named.get("inputs") is not None else named.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    config = call_config(model, named)
    mask = named.get("attention_mask")
    check_padding(ids, mask, config.pad_token_id)
    rows = ids.shape[0] * int(config.num_return_sequences or 1)
    if rows == 1:
        return
    if named.get("streamer") is not None:
        raise ValueError(f"a streamer takes one sequence (transformers' streamers support batch size 1), got "
                         f"{rows} rows (batch {ids.shape[0]} x num_return_sequences "
                         f"{config.num_return_sequences or 1}); stream one prompt at a time")
    for name in ("output_scores", "output_logits"):
        if getattr(config, name, False):
            raise ValueError(f"assistant decoding of {rows} rows does not return {name}=True (rows commit different "
                             f"numbers of tokens per step); run one prompt at a time for per-step scores")
    if getattr(config, "cache_implementation", None) not in (None, "dynamic"):
        raise ValueError(f"assistant decoding of {rows} rows runs on the default dynamic cache, got "
                         f"cache_implementation={config.cache_implementation!r}; drop it")
    if model.specfit.options.route_source == "oracle":
        raise ValueError("route_source='oracle' measures one row's routes with an extra forward; a batch of "
                         f"{rows} rows needs a deployable source: route_source='auto'")


def check_padding(ids: torch.Tensor, mask, pad_token_id) -> None:
    """Rows of different lengths come left-padded with a mask of the same shape (1: token, 0: padding)."""
    if mask is None:
        if ids.shape[0] > 1 and pad_token_id is not None and bool((ids[:, 0] == pad_token_id).any()):
            row = int((ids[:, 0] == pad_token_id).nonzero()[0, 0])
            raise ValueError(f"row {row} of input_ids starts with the pad token ({pad_token_id}) but no "
                             f"attention_mask was given: pass the tokenizer's attention_mask (padding_side='left') "
                             f"so padding is not read as text")
        return
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask has shape {shape} but input_ids {tuple(ids.shape)}: give one mask value per "
                         f"token (the tokenizer's attention_mask for the same padded batch)")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask holds values other than 0 (padding) and 1 (token)")
    if ids.shape[0] == 1:
        return
    empty = (mask.sum(1) == 0).nonzero()
    if len(empty):
        raise ValueError(f"row {int(empty[0, 0])} of attention_mask is all padding: every prompt needs a token")
    right = (mask[:, 1:] < mask[:, :-1]).any(1).nonzero()  # a token followed by padding
    if len(right):
        row = int(right[0, 0])
        raise ValueError(f"row {row} of the batch is right-padded (attention_mask {mask[row].tolist()}): assistant "
                         f"decoding continues every row at its end, so pad on the left (tokenizer "
                         f"padding_side='left')")
