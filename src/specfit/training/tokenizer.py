"""The embedded model's tokenizer: a 4096-token byte-level BPE trained on the training text only.

One special token, ``<|endoftext|>`` = id 0, serves as bos, eos and pad. The ByteLevel pre-tokenizer and decoder
make ``decode(encode(text)) == text`` for any string. Training is deterministic for a given text order.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..evaluation.datasets import EOS_TEXT

if TYPE_CHECKING:  # annotations only: train-target's options import this module, without transformers
    from transformers import PreTrainedTokenizerFast

EOS_ID = 0
VOCAB_SIZE = 4096


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE, min_frequency: int = 2,
                    model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it for transformers.

    Args:
        texts: training documents; ``<|endoftext|>`` inside them is matched as the special token.
        vocab_size: final vocabulary size, the special token and the 256 byte symbols included.
        min_frequency: a merge needs at least this many occurrences.
        model_max_length: recorded in the tokenizer config (the model's ``max_position_embeddings``).
    Returns:
        A ``PreTrainedTokenizerFast`` with eos = bos = pad = ``<|endoftext|>`` (id 0) that adds no special tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TEXT],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.token_to_id(EOS_TEXT) != EOS_ID:
        raise RuntimeError(f"{EOS_TEXT} got id {tok.token_to_id(EOS_TEXT)}, expected {EOS_ID}")
    return wrap(tok, model_max_length)


def wrap(tok: Tokenizer, model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """Wrap a raw ``tokenizers.Tokenizer`` as a transformers tokenizer with the special-token roles set."""
    from transformers import PreTrainedTokenizerFast  # here, not at the top: the commands' options import this module

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TEXT,
        eos_token=EOS_TEXT,
        pad_token=EOS_TEXT,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # keep decode an exact inverse of encode
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by ``save_pretrained`` (offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_batch(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added (the fast backend, batched)."""
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
