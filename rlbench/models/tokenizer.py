"""The tokenizer of the built-in tiny models, built offline (no hub, no files): one token per byte.

Why a Qwen2 byte-level tokenizer rather than a plain character WordLevel one: the tiny models are
Qwen2 models, and for a `qwen2` config `AutoTokenizer` (transformers 5, hence vLLM too) always
rebuilds the tokenizer as `Qwen2Tokenizer` (NFC, Qwen's pre-tokenizer regex, byte-level BPE),
keeping only the vocabulary and merges of `tokenizer.json`. A vocabulary of byte-level symbols with
no merges behaves identically whichever way the directory is loaded: one token per byte, so one per
ASCII character, and every text round-trips (text in Unicode NFC form: Qwen2's normalizer).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
ASCII_BYTES = [*range(32, 127), ord("\n")]  # printable ASCII, then newline: ids 3..98
_BYTE_OF = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
"""Byte-level BPE's printable symbol -> the byte it stands for."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """ids 0-2 are `<pad>`, `<eos>`, `<unk>` (no BOS), then one per byte (`ASCII_BYTES` first).

    Encoding adds no special tokens and never turns text into one (the text "<eos>" is five tokens,
    `split_special_tokens=True`); decoding joins bytes with nothing in between, so
    `decode(encode(text)) == text` for any (NFC) text. Padding is on the left (decoder-only generation),
    a constructor argument so that it survives `save_pretrained`. No chat template: prompts are text.
    """
    byte_symbol = bytes_to_unicode()  # byte -> the printable symbol byte-level BPE uses for it
    byte_order = ASCII_BYTES + [b for b in range(256) if b not in ASCII_BYTES]
    vocab = {PAD: 0, EOS: 1, UNK: 2} | {byte_symbol[b]: 3 + i for i, b in enumerate(byte_order)}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
    )


def readable_decode(tokenizer, ids: Sequence[int]) -> str:
    """`tokenizer.decode(ids)` for showing tokens: bytes that form no UTF-8 character read `<0xNN>` instead of all
    becoming U+FFFD ("10<0xB7>9", not "10�9": a byte sampled on its own, a character cut by the length limit, a
    token shown alone that holds part of a character). For byte-level BPE tokenizers (the built-in ones, Qwen,
    GPT-2, Llama 3); any other tokenizer's text is `decode`'s.

    For showing only: a reward reads the completion as `decode` gives it (a grader reading numbers would read the
    digits of `<0xNN>`)."""
    text = tokenizer.decode(ids)
    if "\ufffd" not in text:
        return text
    tokens = tokenizer.convert_ids_to_tokens(list(ids))
    if not all(symbol in _BYTE_OF for token in tokens for symbol in token):  # not byte-level BPE
        return text
    # surrogateescape: each undecodable byte b becomes the lone surrogate U+DC00 + b
    chars = bytes(_BYTE_OF[symbol] for token in tokens for symbol in token).decode("utf-8", "surrogateescape")
    return "".join(f"<0x{ord(c) - 0xDC00:02X}>" if "\udc80" <= c <= "\udcff" else c for c in chars)
