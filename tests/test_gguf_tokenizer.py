"""GGUF byte-level BPE tokenizers cut text into words as `tokenizer.ggml.pre` says, like the model's own tokenizer.

For each pre-tokenizer type a small BPE is trained with the `tokenizers` library under that model family's
real tokenizer.json settings (normalizer, pre_tokenizer, BPE flags), written into a GGUF with the gguf
package's writer, and loaded back the way tokenmill loads a .gguf; both must give the same ids.
"""

from __future__ import annotations

import json
import logging
import os
import unicodedata

import pytest

from tokenmill.model import gguf_tokenizer
from tokenmill.model.gguf_loader import GGUFFile, build_tokenizer
from tokenmill.model.loader import load_tokenizer

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
# In the vocabulary but not reachable by merges: only a tokenizer that ignores merges for whole words finds it.
WHOLE_WORD = "\u0120zyxwv"  # " zyxwv" in the byte-level alphabet

CORPUS = """def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):\r\n    print(i * i, end=", ")
The numbers 12345 and 678 and 3.14159 and 1,000,000 and 2024-05-17 are here.
I'll say it: don't, can't, won't, we've, you're, she'd, it's, THEY'RE, I'M.
Ünïcödé café naïve résumé — “quotes” and ‘single’ ½ ² ³ ٣ 🙂🚀
日本語のテキストです。中文字符和标点，还有한국어 문장입니다.
Ελληνικά και русский текст, \u2126mega \u212aelvin \u1fd3 \u1f7d.
नमस्ते दुनिया, यह हिंदी पाठ है। مرحبا بالعالم، هذا نص عربي.
สวัสดีชาวโลก นี่คือภาษาไทย 🙂 ok
"""

TEXTS = [
    "def fibonacci(n):\n    return n",
    "fibonacci(n):\n",
    "12345 678 3.14159 1,000,000 x2024y",
    "don't I'll we've SHE'S they'D",
    "a  b   c\n\n\n  \t x  \r\n end   ",
    "   leading and trailing   \n",
    "Ünïcödé café naïve — “quotes” 🙂🚀 ½²",
    "cafe\u0301 re\u0301sume\u0301",  # decomposed accents: NFC changes them
    "日本語のテキスト、中文字符。한국어 문장",
    "Ελληνικά \u1fd3 \u2126 \u212a \u1f7d русский",  # letters with look-alikes elsewhere in Unicode
    "नमस्ते दुनिया। مرحبا بالعالم سلام",
    "สวัสดีชาวโลก ภาษา 🙂 ½ — x",
    "<|im_start|>user\nHi<|im_end|>\n<think>ok</think>",
    "say zyxwv and zyxwvu",
    "",
]


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _sequence(*steps: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(steps)}


_DIGITS = {"type": "Digits", "individual_digits": True}
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_LETTERS = gguf_tokenizer._DEEPSEEK_CASED_LETTERS  # 200 code points; checked against two sources

# `tokenizer.ggml.pre` -> what the model's tokenizer.json has: (normalizer, pre_tokenizer, BPE ignore_merges,
# BOS added). gpt2: GPT-2; llama-bpe: Llama 3; qwen2: Qwen2.5; deepseek-llm: DeepSeek LLM 7B; smollm: SmolLM2.
REAL = {
    "gpt2": (None, _byte_level(True), False, False),
    "llama-bpe": (None, _sequence(_split(_LLAMA3), _byte_level(False)), True, True),
    "qwen2": ({"type": "NFC"}, _sequence(_split(_QWEN2), _byte_level(False)), False, False),
    "deepseek-llm": ({"type": "Sequence", "normalizers": []}, _sequence(
        _split("[\r\n]"),
        _split(r"\s?[" + _DEEPSEEK_LETTERS + "]+"),
        _split(r"\s?[!-/:-~！-／：-～‘-‟　-。]+"),
        _split(r"\s+$"),
        _split("[一-龥ࠀ-一가-퟿]+"),
        _DIGITS,
        _byte_level(False),
    ), False, True),
    "smollm": (None, _sequence(_DIGITS, _byte_level(True)), False, False),
}


def reference_tokenizer(pre: str):
    """A byte-level BPE trained under `pre`'s real tokenizer.json settings."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers, processors, trainers

    normalizer, pre_tokenizer, ignore_merges, add_bos = REAL[pre]
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": _byte_level(True),
            "model": {"type": "BPE", "vocab": {}, "merges": []}}
    tok = Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 3, trainer)
    trained = json.loads(tok.to_str())
    trained["model"]["ignore_merges"] = ignore_merges
    trained["model"]["vocab"][WHOLE_WORD] = tok.get_vocab_size()
    tok = Tokenizer.from_str(json.dumps(trained))
    tok.add_tokens([AddedToken(USER_DEFINED, special=False, normalized=False)])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[0]} $A",
                                                           special_tokens=[(SPECIALS[0], 0)])
    return tok


def write_gguf(path, tok, pre: str | None, add_bos: bool) -> str:
    """A tokenizer-only GGUF holding `tok`'s vocabulary, token types and merges, as llama.cpp's converter writes."""
    import gguf

    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    added = {a.content: a for a in tok.get_added_tokens_decoder().values()}
    types = [(3 if added[t].special else 4) if t in added else 1 for t in tokens]
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tokenizers_by_pre(tmp_path_factory):
    """pre -> (reference tokenizer, path of the GGUF holding its vocabulary)."""
    root = tmp_path_factory.mktemp("gguf_tok")
    out = {}
    for pre, (_, _, _, add_bos) in REAL.items():
        ref = reference_tokenizer(pre)
        out[pre] = ref, write_gguf(root / f"{pre}.gguf", ref, pre, add_bos)
    return out


@pytest.mark.parametrize("pre", list(REAL))
def test_gguf_tokenizer_matches_the_models_own(tokenizers_by_pre, pre):
    ref, path = tokenizers_by_pre[pre]
    ours = load_tokenizer(path)
    # The words themselves, not only the ids: a vocabulary trained on single digits gives the same ids
    # whether or not digits are split, yet a real one may hold merges across the boundaries.
    for text in TEXTS:
        norm = ref.normalizer.normalize_str(text) if ref.normalizer else text
        assert ours.backend_tokenizer.pre_tokenizer.pre_tokenize_str(norm) == \
            ref.pre_tokenizer.pre_tokenize_str(norm), text
    mismatches = []
    for text in TEXTS:
        want = ref.encode(text).ids
        got = ours.encode(text)
        if got != want:
            mismatches.append((text, [ours.convert_ids_to_tokens(got), ref.encode(text).tokens]))
        assert ours.decode(got) == ref.decode(got, skip_special_tokens=False), text
    assert not mismatches, mismatches
    assert ours.bos_token_id == 0 and ours.eos_token_id == 1


def test_qwen2_splits_calls_like_qwen(tokenizers_by_pre):
    """The case seen on a Qwen2.5 GGUF: `(n` and `):\\n` are words of their own, not `(`, `n`, `):`, `\\n`."""
    ref, path = tokenizers_by_pre["qwen2"]
    pieces = ref.pre_tokenizer.pre_tokenize_str("fibonacci(n):\n")
    assert [p for p, _ in pieces] == ["fibonacci", "(n", "):\u010a"]
    ours = load_tokenizer(path)
    assert ours.convert_ids_to_tokens(ours.encode("fibonacci(n):\n")) == ref.encode("fibonacci(n):\n").tokens


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_transformers_reads_the_same_gguf_alike(tokenizers_by_pre, pre):
    """transformers' own GGUF conversion, where it knows the type, agrees (it skips NFC and ignore_merges)."""
    from transformers import AutoTokenizer

    ref, path = tokenizers_by_pre[pre]
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = load_tokenizer(path)
    for text in TEXTS:
        if unicodedata.normalize("NFC", text) != text or "zyxwv" in text:
            continue
        assert ours.encode(text) == theirs.encode(text), text


def test_missing_pre_reads_as_gpt2(tokenizers_by_pre, tmp_path):
    """Files from before `tokenizer.ggml.pre` existed split text with GPT-2's regex, as transformers reads them."""
    ref, _ = tokenizers_by_pre["gpt2"]
    ours = load_tokenizer(write_gguf(tmp_path / "old.gguf", ref, None, False))
    assert [ours.encode(t) for t in TEXTS] == [ref.encode(t).ids for t in TEXTS]


def test_unknown_pre_goes_to_transformers(tokenizers_by_pre, tmp_path, caplog):
    """A type tokenmill has no entry for is built by transformers' GGUF conversion, and the log says so."""
    from transformers import AutoTokenizer

    ref, _ = tokenizers_by_pre["llama-bpe"]
    path = write_gguf(tmp_path / "tekken.gguf", ref, "tekken", False)
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        assert build_tokenizer(GGUFFile(path)) is None
    assert "'tekken'" in caplog.text and "transformers" in caplog.text
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tekken.gguf")
    assert [ours.encode(t) for t in TEXTS] == [theirs.encode(t) for t in TEXTS]


def test_a_tokenizer_transformers_cannot_build_is_a_clear_error(tmp_path):
    """A type tokenmill has no entry for, whose vocabulary transformers' conversion refuses (a merge of a token
    the vocabulary lacks): a ValueError naming the file, not the conversion's own exception."""
    import gguf

    path = tmp_path / "broken.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("tekken")
    writer.add_token_list(["<s>", "</s>", "a", "b", "ab"])
    writer.add_token_types([3, 3, 1, 1, 1])
    writer.add_token_merges(["a b", "ab c"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"broken\.gguf: could not build the file's tokenizer"):
        load_tokenizer(str(path))
