"""tokenmill export onnx: the graph, run by onnxruntime as an Optimum-style generation loop drives it (a padded
batch, then decode steps that feed back the present keys and values), gives tokenmill's own logits, on a
tiny model of each family and on the real default model."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from tests.conftest import ARCHS, PROMPTS  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.cli import main  # noqa: E402
from tokenmill.export.onnx import OPSET, export_onnx, io_names  # noqa: E402

STEPS = 3  # the prompt step and two decode steps


def tokenmill_logits(llm: LLM, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy tokens of STEPS steps and the logits [STEPS, vocab] each was chosen from, as the engine
    computed them (fused decode steps included)."""
    runner = llm.engine.runner
    seen = []
    choose = runner._choose

    def spy(out, logits, items, rows):
        seen.append(logits[rows[0]].float().clone())
        return choose(out, logits, items, rows)

    runner._choose = spy
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
                           use_tqdm=False)[0]
    finally:
        runner._choose = choose
    return list(out.outputs[0].token_ids), torch.stack(seen).numpy()


def onnx_logits(path: str, prompts: list[list[int]], continuations: list[list[int]]) -> np.ndarray:
    """Logits [batch, STEPS, vocab]: the prompts left-padded into one batch, then each decode step feeding
    the next of its continuation tokens with the cache the graph returned."""
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    inputs, outputs = io_names(sum(n.startswith("past_key_values.") for n in (i.name for i in session.get_inputs()))
                               // 2)
    shape = next(i.shape for i in session.get_inputs() if i.name == "past_key_values.0.key")
    width = max(map(len, prompts))
    ids = np.array([[0] * (width - len(p)) + p for p in prompts], dtype=np.int64)
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": mask,
            "position_ids": np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int64)}
    feed.update({name: np.zeros((len(prompts), shape[1], 0, shape[3]), dtype=np.float32) for name in inputs[3:]})
    steps = []
    for step in range(STEPS):
        result = dict(zip(outputs, session.run(outputs, feed)))
        steps.append(result["logits"][:, -1])
        if step == STEPS - 1:
            break
        mask = np.concatenate([mask, np.ones((len(prompts), 1), dtype=np.int64)], axis=1)
        feed = {"input_ids": np.array([[c[step]] for c in continuations], dtype=np.int64), "attention_mask": mask,
                "position_ids": (mask.sum(axis=1, keepdims=True) - 1).astype(np.int64)}
        feed.update({i: result[o] for i, o in zip(inputs[3:], outputs[1:])})
    return np.stack(steps, axis=1)


def check_export(model: str, out_dir: str, prompts: list[list[int]], atol: float) -> None:
    path = export_onnx(model, out_dir)
    graph = onnx.load(path, load_external_data=False)
    assert [o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")] == [OPSET]
    llm = LLM(model, dtype="float32", quantization="none", seed=0, kv_cache_memory="16MiB")
    results = [tokenmill_logits(llm, p) for p in prompts]
    got = onnx_logits(path, prompts, [tokens for tokens, _ in results])
    for i, (_, want) in enumerate(results):
        np.testing.assert_allclose(got[i], want, rtol=0, atol=atol, err_msg=f"prompt {i}")
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    assert config["num_hidden_layers"] == llm.engine.model.config.num_layers and config["use_cache"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    assert tok.encode("The quick brown fox") == llm.get_tokenizer().encode("The quick brown fox")


@pytest.mark.parametrize("arch", ARCHS)
def test_onnx_graph_gives_tokenmills_logits(tiny_models, tmp_path, arch):
    """A short and a long prompt in one left-padded batch (Gemma 3's window of 8 and Phi-3's LongRoPE switch
    at 24 lie inside the long one), then two decode steps with the cache. The mixture-of-experts models
    (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, gpt-oss with expert biases and attention sinks)
    route each token in the graph."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models[arch])
    prompts = [tok.encode(PROMPTS[0]), tok.encode(PROMPTS[2])]
    check_export(tiny_models[arch], str(tmp_path / "onnx"), prompts, atol=1e-4)


@pytest.mark.slow
def test_onnx_graph_of_the_default_model(default_gguf, tmp_path):
    """The real default model (its Q8_0 blocks dequantized to float32, as tokenmill's quantization='none')."""
    from tokenmill.model.loader import load_tokenizer

    tok = load_tokenizer(default_gguf)
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    if n < 2:")]
    check_export(default_gguf, str(tmp_path / "onnx"), prompts, atol=1e-4)


def test_export_errors_say_what_is_wrong(tiny_models, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["export", "onnx", tiny_models["llama"], str(blocker / "out")]) == 2
    assert "cannot write the export to" in capsys.readouterr().err
    folder = tmp_path / "unknown"
    shutil.copytree(tiny_models["llama"], folder)
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert main(["export", "onnx", str(folder), str(tmp_path / "out")]) == 2
    assert "unsupported model architecture ['GPT2LMHeadModel']" in capsys.readouterr().err
