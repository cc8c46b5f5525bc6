"""Byte-level BPE tokenizers from GGUF metadata, split into words the way `tokenizer.ggml.pre` names.

A GGUF keeps a BPE ("gpt2") vocabulary and its merges, but not how text is cut into words before the merges
run: it only names that recipe in `tokenizer.ggml.pre` (llama.cpp's pre-tokenizer types). Merges learned on
one cutting give other tokens under another, so each name maps here to the pre-tokenizer of the model's own
tokenizer.json. Names not in the table go to transformers' GGUF conversion instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger("tokenmill")

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How one family of models cuts text into words before BPE, as its tokenizer.json says."""

    splits: tuple[str, ...] = ()  # regexes applied in turn; every match becomes a word of its own
    individual_digits: bool = False  # then every digit a word of its own
    gpt2_regex: bool = False  # then GPT-2's regex, applied by the ByteLevel step itself
    nfc: bool = False  # text NFC-normalized first
    ignore_merges: bool = False  # a word that is itself a token is kept whole, merges unused


# Llama 3's tokenizer.json regex: like GPT-4's, numbers in runs of up to three digits.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: Llama 3's with single digits.
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's five splits. The letter class lists the cased letters (those with upper and lower forms);
# written as escapes because several of them look like other code points (U+1F7D and U+03CE, U+212A and K).
_DEEPSEEK_CASED_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    rf"\s?[{_DEEPSEEK_CASED_LETTERS}]+",
    r"\s?[!-/:-~" "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",  # ASCII and full-width punctuation
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",  # CJK ideographs, Hangul, and the scripts between
)

_GPT2 = PreTokenizer(gpt2_regex=True)
_LLAMA3 = PreTokenizer(splits=(_LLAMA3_REGEX,), ignore_merges=True)
_QWEN2 = PreTokenizer(splits=(_QWEN2_REGEX,), nfc=True)
_DEEPSEEK_LLM = PreTokenizer(splits=_DEEPSEEK_LLM_SPLITS, individual_digits=True)
_STARCODER = PreTokenizer(individual_digits=True, gpt2_regex=True)

# `tokenizer.ggml.pre` -> pre-tokenizer. Only names whose models' tokenizer.json is known to match the entry;
# the rest are left to transformers rather than guessed.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # llama.cpp's "default" chains some ad hoc regexes of its own; files saying it (or nothing) predate the
    # key, were mostly GPT-2-style vocabularies, and transformers reads them with GPT-2's regex too.
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-llm": _DEEPSEEK_LLM,
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
}


def pre_tokenizer_for(name: str | None) -> PreTokenizer | None:
    """The table entry for a `tokenizer.ggml.pre` value (absent: "default"); None when it has none."""
    return PRE_TOKENIZERS.get(name or "default")


def build_tokenizer(fields: Mapping[str, object]):
    """A transformers fast tokenizer from GGUF metadata; None where transformers' own GGUF conversion must build it."""
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        return None  # SentencePiece and other vocabularies: transformers knows their quirks
    pre_name = fields.get("tokenizer.ggml.pre")
    pre = pre_tokenizer_for(pre_name)
    if pre is None:
        logger.info("GGUF pre-tokenizer %r is not in tokenmill's table; building the tokenizer with "
                    "transformers' GGUF conversion instead", pre_name)
        return None

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre.ignore_merges))
    if pre.nfc:
        # Qwen2's tokenizer.json normalizes to NFC (llama.cpp does not); transformers is the reference here.
        tok.normalizer = normalizers.NFC()
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    if pre.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.gpt2_regex))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # Control and user-defined tokens are matched whole in the text, never split by BPE.
    specials = [AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False) for i in range(len(tokens))
                if types[i] in (_CONTROL, _USER_DEFINED)]
    tok.add_tokens(specials)

    def tok_of(key):
        i = fields.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = tok_of("bos")
    if fields.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=tok_of("eos"),
                                 unk_token=tok_of("unknown"), pad_token=tok_of("padding"))
    template = fields.get("tokenizer.chat_template")
    if template:
        hf.chat_template = template
    return hf
