"""A model as one tensor-parallel rank's shard: its layers cut (shard.py) and wired to sum over the group.

One sum after attention (o) and one after the MLP (down, or the whole mixture of experts), one for the
embedding (each rank holds a slice of the vocabulary's rows), and a gather of the output layer's slices.
The fused CPU decode step does the same inside its own loop (FusedDecoder.set_group).
"""

from __future__ import annotations

import torch

from tokenmill.distributed.shard import Shard
from tokenmill.model.layers import Embedding, GatedMLP, Linear
from tokenmill.model.moe import SparseMoE


def make_shard(model, shard: Shard, group) -> None:
    """Turns a model built (on the meta device) from shard.config(...) into rank shard.rank's shard: the
    embedding and output layer hold the rank's vocabulary rows, and the row-parallel products sum over group."""
    cfg = model.config
    v0, v1 = shard.vocab_range
    model.embed_tokens = Embedding(v1 - v0, cfg.hidden_size)
    model.embed_tokens.shard_of(v0, shard.vocab, group)
    if model.lm_head is not None:
        model.lm_head = Linear(cfg.hidden_size, v1 - v0, bias=False)
    model.tp_group, model.tp_shard = group, shard
    for layer in model.layers:
        layer.self_attn.o_proj.sum_group = group
        if isinstance(layer.mlp, GatedMLP):
            layer.mlp.down_proj.sum_group = group
        elif isinstance(layer.mlp, SparseMoE):
            layer.mlp.sum_group = group  # the experts' and the shared expert's partial sums, in one


def cut_float_weights(model, shard: Shard, weights):
    """The checkpoint stream with each float tensor cut to the rank's part (block-format weights arrive cut)."""
    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor):
            tensor = shard.float_tensor(model.canonical_name(name.removeprefix("model.")), tensor)
        yield name, tensor


def gather_vocab(group, local: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rows [..., vocab] of the whole vocabulary from each rank's [..., its slice] (slices of ceil(vocab /
    world) in rank order, the last one shorter)."""
    world = group.world
    size = -(-vocab // world)
    lead = local.shape[:-1]
    flat = local.reshape(-1, local.shape[-1]).float()
    if flat.shape[1] < size:
        flat = torch.nn.functional.pad(flat, (0, size - flat.shape[1]))
    every = group.all_gather(flat)  # [world, rows, size]
    whole = every.permute(1, 0, 2).reshape(flat.shape[0], world * size)[:, :vocab]
    return whole.to(local.dtype).reshape(*lead, vocab)
