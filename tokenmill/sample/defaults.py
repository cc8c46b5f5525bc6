"""The sampling settings of requests that leave them out.

A model file may say how it wants to be sampled; many don't (a GGUF rarely carries a generation_config),
and sampling a small chat model at temperature 1 with no truncation gives poor answers. The defaults
come from the first of these that sets any sampling field:

1. the model's generation_config (generation_config.json of a Hugging Face folder, or --generation-config
   PATH);
2. the GGUF file's general.sampling.* metadata;
3. the values recommended for a built-in model (kept beside its download recipe in model/hub.py);
4. llama.cpp's defaults: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05.

Fields the chosen source leaves unset keep the neutral values of SamplingParams (temperature 1, no
truncation). `--generation-config vllm` skips the chain and keeps the neutral values everywhere, as the
OpenAI API defines them. `--override-generation-config JSON` is applied last, over whichever source won.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tokenmill.sampling_params import SamplingParams

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# GGUF general.sampling.* keys that map onto our fields (mirostat, XTC and the rest have no equivalent).
GGUF_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "penalty_repeat": "repetition_penalty"}
MODES = ("auto", "vllm")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    values: dict  # field -> value; unset fields keep SamplingParams' own defaults
    source: str  # where they come from, for the start-up log and /v1/models

    def params(self) -> SamplingParams:
        return SamplingParams(**self.values)

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v:g}" for k, v in self.values.items()) or "temperature=1, no truncation"
        return f"{shown} (from {self.source})"


def from_generation_config(gen: dict) -> dict:
    """Sampling fields of a transformers generation_config; do_sample false means greedy."""
    values = {k: gen[k] for k in FIELDS if gen.get(k) is not None}
    if gen.get("do_sample") is False:
        values = {"temperature": 0.0}
    if values.get("top_k") == 0 or values.get("top_k") == -1:
        values["top_k"] = 0
    return values


def from_gguf(fields: dict) -> dict:
    """Sampling fields of a GGUF file's general.sampling.* metadata."""
    values = {}
    for key, ours in GGUF_KEYS.items():
        value = fields.get(f"general.sampling.{key}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values[ours] = int(value) if ours == "top_k" else float(value)
    return values


def read_generation_config(path: str) -> dict:
    """generation_config.json from a folder, or a JSON file given directly."""
    file = os.path.join(path, "generation_config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            gen = json.load(f)
    except OSError as e:
        raise ValueError(f"generation_config {path!r}: no generation_config.json there ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"generation_config {file!r} is not valid JSON: {e}") from e
    if not isinstance(gen, dict):
        raise ValueError(f"generation_config {file!r} must hold a JSON object")
    return gen


def resolve(mode: str, generation_config: dict, gguf_fields: dict, named_model: str | None,
            override: dict | None = None) -> SamplingDefaults:
    """The defaults in force for a model; mode is auto, vllm or a path to a generation config."""
    from tokenmill.model.hub import NAMED_MODELS

    if mode == "vllm":
        chosen = SamplingDefaults({}, "--generation-config vllm: neutral OpenAI defaults")
    else:
        if mode != "auto":
            generation_config, gen_source = read_generation_config(mode), f"generation config {mode}"
        else:
            gen_source = "the model's generation_config"
        chain = [(from_generation_config(generation_config), gen_source),
                 (from_gguf(gguf_fields), "the GGUF file's general.sampling metadata")]
        if named_model in NAMED_MODELS:
            chain.append((dict(NAMED_MODELS[named_model].sampling), f"the recommended settings of {named_model}"))
        chain.append((dict(LLAMA_CPP), "llama.cpp-style defaults: the model names none"))
        chosen = next(SamplingDefaults(values, source) for values, source in chain if values)
    if override:
        unknown = sorted(set(override) - set(FIELDS))
        if unknown:
            raise ValueError(f"override_generation_config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(FIELDS)}")
        chosen = SamplingDefaults({**chosen.values, **override}, chosen.source + ", with overrides")
    chosen.params()  # a bad value in a file or an override is an error now, not in every request
    return chosen
