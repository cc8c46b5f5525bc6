"""tokenmill eval perplexity: windows as llama-perplexity cuts them, scores against transformers."""

import math

import pytest
import torch

from tokenmill import LLM
from tokenmill.eval import perplexity, windows


def test_windows_score_the_second_half_once():
    toks = list(range(100, 140))
    wins = windows(toks, ctx=16, stride=16, bos=None)
    assert [w[0] for w, _ in wins] == [100, 116]  # back to back; the last 8 tokens make no full window
    assert all(first == 8 for _, first in wins)
    half = windows(toks, ctx=16, stride=8, bos=7)
    assert [w[:2] for w, _ in half] == [[7, 101], [7, 109], [7, 117], [7, 125]]  # BOS replaces the first token
    quarter = windows(toks, ctx=16, stride=4, bos=None)
    assert all(first == 12 for _, first in quarter)  # only the tokens the previous window did not score
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(toks[:10], ctx=16, stride=16, bos=None)
    with pytest.raises(ValueError, match="stride"):
        windows(toks, ctx=16, stride=32, bos=None)


def test_perplexity_matches_transformers(tiny_models):
    """The same windows scored by transformers give the same perplexity."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import TEXT

    folder = tiny_models["llama"]
    llm = LLM(folder, dtype="float32", kv_cache_memory="16MiB", enable_prefix_caching=False)
    text = TEXT * 3
    got = perplexity(llm, text, ctx=32, stride=16, progress=False)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    losses = []
    with torch.no_grad():
        for w, first in windows(ids, 32, 16, None):
            logp = model(torch.tensor([w])).logits[0].log_softmax(-1)
            losses += [-logp[i - 1, w[i]].item() for i in range(first, 32)]
    assert got.tokens_scored == len(losses) and got.windows == len(windows(ids, 32, 16, None))
    assert got.perplexity == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-4)


def test_eval_perplexity_command(tiny_models, tmp_path, capsys):
    from tests.conftest import TEXT
    from tokenmill.cli import main

    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    folder = tiny_models["llama"]
    assert main(["eval", "perplexity", folder, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--text", str(text),
                 "--ctx", "32", "--stride", "16", "--max-windows", "3"]) == 0
    out = capsys.readouterr().out
    llm = LLM(folder, dtype="float32", kv_cache_memory="16MiB", enable_prefix_caching=False)
    want = perplexity(llm, TEXT * 3, ctx=32, stride=16, max_windows=3, progress=False)
    assert want.windows == 3 and want.tokens_scored == 3 * 16
    assert f"perplexity {want.perplexity:.4f}" in out and "over 48 tokens (3 windows of 32 tokens" in out
    assert main(["eval", "perplexity", folder, "--text", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read the text" in capsys.readouterr().err


def test_calibration_text_is_another_text_than_the_evaluation_text():
    """An importance matrix computed on the calibration text must not have seen the evaluation text."""
    from tokenmill.data import calibration_text, corpus_text, default_text

    evaluation, calibration = default_text(), calibration_text()
    assert len(evaluation) > 100_000 and len(calibration) > 300_000
    assert "\r" not in calibration and not calibration.endswith("\x1a")
    long_lines = {line.strip() for line in evaluation.splitlines() if len(line.strip()) >= 50}
    assert len(long_lines) > 500
    assert not long_lines & {line.strip() for line in calibration.splitlines()}
    with pytest.raises(ValueError, match="no built-in text"):
        corpus_text("plrabn12.txt")
