"""Tokenizers built in-process (no hub): a character-level tokenizer for tiny models and demos.

Real checkpoints bring their own ``tokenizer.json`` (read by ``fp8rl_jax.checkpoint
.load_tokenizer``); tiny models made by tests, demos and the quickstart use this one, saved as a
standard ``tokenizer.json`` so the same loading path serves both.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

DEFAULT_ALPHABET = string.digits + string.ascii_letters + " +-=*/.,:;?!()[]{}<>'\"\n"
DEFAULT_SPECIALS = ("<pad>", "<eos>")


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET, special_tokens: tuple[str, ...] = DEFAULT_SPECIALS) -> Tokenizer:
    """One token per character; special tokens take ids 0.. in order (``<pad>`` = 0, ``<eos>`` = 1).

    Unknown characters map to the first special token.
    """
    if not special_tokens:
        raise ValueError("char_tokenizer needs at least one special token (used for unknown characters)")
    vocab: dict[str, int] = {}
    for tok in (*special_tokens, *alphabet):
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special_tokens[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(special_tokens))
    return tok
