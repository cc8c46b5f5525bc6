"""The attention backend interface: metadata built once per step, one call per layer."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each request attends to, for one mixed batch.

    Tokens are laid out request after request. Requests with a single new token (decode) come first
    so that they can be attended to in one batched call.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    query_start_loc: list[int]  # [num_reqs + 1] offsets of each request's tokens
    seq_lens: list[int]  # [num_reqs] context length after this step
    num_decodes: int  # the first num_decodes requests have exactly one new token
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] padded with 0
    decode_seq_lens: torch.Tensor | None  # [num_decodes]
    block_tables: list[torch.Tensor]  # per request, its block ids (for the prefill path)
    block_size: int
    # [num_tokens] how many tokens (prompt and output so far) each token's request holds, for models whose
    # rotation of a token depends on it (LongRoPE). None: by position alone, right for each request's last token.
    request_lens: torch.Tensor | None = None
    # How many of the last tokens are rows of a prompt (a chunk wholly inside its request's prompt): their
    # products with quantized weights take float inputs (kernels/quant.py), and the step runs module by module.
    num_prompt_rows: int = 0
    # Filled by a backend on the first layer and reused by the others (gather indices, masks).
    cache: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend:
    """Writes new K/V into the paged cache and computes attention for a mixed batch."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D]. Returns [T, H, D]. softcap: the
        logits (scaled q.k) become softcap * tanh(logits / softcap) before the softmax. sinks [H]: each
        head's softmax also takes this logit, whose share of the probability goes to no value."""
        raise NotImplementedError


BACKENDS = ("torch", "triton")


def new_backend(device) -> AttentionBackend:
    """The attention backend TOKENMILL_ATTENTION_BACKEND names: "torch" (the default: the CPU kernels where
    they run, torch's operators elsewhere) or "triton" (attention/triton_paged.py: paged kernels for CUDA
    GPUs; on the CPU only under Triton's interpreter, TRITON_INTERPRET=1, which is how tests run it)."""
    name = os.environ.get("TOKENMILL_ATTENTION_BACKEND", "torch")
    if name not in BACKENDS:
        raise ValueError(f"TOKENMILL_ATTENTION_BACKEND must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "triton":
        if getattr(device, "type", str(device)) != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the Triton attention backend runs on CUDA GPUs (on the CPU only under "
                             "TRITON_INTERPRET=1, Triton's interpreter, for tests)")
        try:
            from tokenmill.attention.triton_paged import TritonPagedBackend
        except ImportError as e:
            raise ValueError(f"the Triton attention backend needs the triton package: {e}") from e
        logging.getLogger("tokenmill").info("attention: Triton paged kernels (TOKENMILL_ATTENTION_BACKEND=triton)")
        return TritonPagedBackend()
    from tokenmill.attention.cpu import TorchSDPABackend

    return TorchSDPABackend()
