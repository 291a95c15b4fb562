"""Import `torch.nn` transformer layers into our `Block`, and `torch.nn.RMSNorm` into our RMSNorm.

Mapping (our name <- torch name):

- `self_attn.qkv_proj`  <- `self_attn.in_proj_weight` / `in_proj_bias`. Both are fused with rows
  [q; k; v], so the copy is direct.
- `self_attn.o_proj`    <- `self_attn.out_proj`.
- `cross_attn.q_proj`   <- the first d_model rows of `multihead_attn.in_proj_*` (decoder layers);
  `cross_attn.kv_proj`  <- the remaining 2 d_model rows, [k; v];
  `cross_attn.o_proj`   <- `multihead_attn.out_proj`.
- `ffn.w_in` / `ffn.w_out` <- `linear1` / `linear2`.
- residual norms, in order: `self_attn_residual.norm` <- `norm1`; for a decoder layer
  `cross_attn_residual.norm` <- `norm2` and `ffn_residual.norm` <- `norm3`; for an encoder layer
  `ffn_residual.norm` <- `norm2`.

`norm_first=False` is our `norm_position="post"`, `norm_first=True` is `"pre"` (a torch layer
has no final norm, and neither does a lone `Block`). `bias=False` in torch drops the biases of
the projections and of the LayerNorms, which is exactly what our `bias=False` does.

Mask conventions differ: torch's `*_key_padding_mask` is True at *padding*; ours (and
`run_block` here) takes True at *real tokens*.

Dropout: the two compute the same function in eval mode, or with dropout 0. In training with dropout > 0
they regularise differently: torch's layer also drops out inside the feed-forward block, after the
activation (`linear2(dropout(activation(linear1(x))))`), where our FFN, as GPT-2's, Llama's and the
original Transformer's (Vaswani et al. 2017, section 5.4: dropout on each sublayer's output), has none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from study.axes.norm import RMSNorm
from study.config.model import ModelConfig
from study.model.attention import attention_bias
from study.model.transformer import Block, StackInputs

__all__ = [
    "config_from_torch_layer",
    "block_from_torch",
    "load_torch_layer",
    "run_block",
    "rmsnorm_from_torch",
]

TorchLayer = nn.TransformerEncoderLayer | nn.TransformerDecoderLayer


def _activation_name(act) -> str:
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if act is F.silu or isinstance(act, nn.SiLU):
        return "silu"
    raise ValueError(
        f"cannot import a torch transformer layer with activation {act!r}: supported are relu, gelu "
        "(exact or tanh), silu"
    )


def _check_mha(mha: nn.MultiheadAttention, what: str) -> None:
    if not mha._qkv_same_embed_dim:
        raise ValueError(f"{what}: kdim/vdim different from embed_dim is not supported (our attention is square)")
    if mha.bias_k is not None or mha.bias_v is not None:
        raise ValueError(f"{what}: add_bias_kv=True is not supported")
    if mha.add_zero_attn:
        raise ValueError(f"{what}: add_zero_attn=True is not supported")


def config_from_torch_layer(layer: TorchLayer, **overrides) -> ModelConfig:
    """A `ModelConfig` whose `Block` has the same shape and recipe as `layer`.

    An encoder layer becomes arch='encoder', a decoder layer arch='encoder-decoder' (its block
    has cross-attention). Vocabulary, positions and depth are irrelevant to one block and left
    minimal; pass `overrides` to change any field.
    """
    if not isinstance(layer, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        raise TypeError(f"expected nn.TransformerEncoderLayer or nn.TransformerDecoderLayer, got {type(layer).__name__}")
    decoder = isinstance(layer, nn.TransformerDecoderLayer)
    _check_mha(layer.self_attn, "self_attn")
    if decoder:
        _check_mha(layer.multihead_attn, "multihead_attn")
    bias = layer.linear1.bias is not None
    fields = dict(
        arch="encoder-decoder" if decoder else "encoder",
        d_model=layer.self_attn.embed_dim,
        n_heads=layer.self_attn.num_heads,
        d_ff=layer.linear1.out_features,
        n_layers=1,
        vocab_size=1,
        position="none",
        norm="layernorm",
        norm_eps=layer.norm1.eps,
        norm_position="pre" if layer.norm_first else "post",
        activation=_activation_name(layer.activation),
        bias=bias,
        dropout=float(layer.dropout.p),
        attention_dropout=float(layer.self_attn.dropout),
    )
    fields.update(overrides)
    return ModelConfig.from_dict(fields)


@torch.no_grad()
def copy_parameter(
    dst: torch.Tensor | None, src: torch.Tensor | None, name: str, missing_error: type[Exception] = ValueError
) -> bool:
    """Copy `src` into our `dst`, checking that both exist (or neither) and that shapes agree.
    Returns whether anything was copied. Shared by the torch.nn and Hugging Face importers."""
    if dst is None and src is None:
        return False
    if dst is None or src is None:
        raise missing_error(f"{name}: present on one side only (bias settings differ?)")
    if dst.shape != src.shape:
        raise ValueError(f"{name}: source shape {tuple(src.shape)} does not fit ours {tuple(dst.shape)}")
    dst.copy_(src)
    return True


def _copy_norm(ours: nn.Module, theirs: nn.LayerNorm, name: str) -> None:
    copy_parameter(ours.weight, theirs.weight, f"{name}.weight")
    copy_parameter(getattr(ours, "bias", None), theirs.bias, f"{name}.bias")


@torch.no_grad()
def load_torch_layer(block: Block, layer: TorchLayer) -> Block:
    """Copy the weights of a torch transformer layer into an existing `Block` (see module docstring)."""
    decoder = isinstance(layer, nn.TransformerDecoderLayer)
    if decoder != (block.cross_attn is not None):
        raise ValueError("a TransformerDecoderLayer needs a block with cross-attention and an encoder layer one without")
    sa = layer.self_attn
    copy_parameter(block.self_attn.qkv_proj.weight, sa.in_proj_weight, "self_attn.in_proj_weight")
    copy_parameter(block.self_attn.qkv_proj.bias, sa.in_proj_bias, "self_attn.in_proj_bias")
    copy_parameter(block.self_attn.o_proj.weight, sa.out_proj.weight, "self_attn.out_proj.weight")
    copy_parameter(block.self_attn.o_proj.bias, sa.out_proj.bias, "self_attn.out_proj.bias")
    _copy_norm(block.self_attn_residual.norm, layer.norm1, "norm1")
    if decoder:
        ca = layer.multihead_attn
        d = ca.embed_dim
        copy_parameter(block.cross_attn.q_proj.weight, ca.in_proj_weight[:d], "multihead_attn.in_proj_weight[q]")
        copy_parameter(block.cross_attn.kv_proj.weight, ca.in_proj_weight[d:], "multihead_attn.in_proj_weight[k;v]")
        if ca.in_proj_bias is not None or block.cross_attn.q_proj.bias is not None:
            bias = ca.in_proj_bias
            copy_parameter(block.cross_attn.q_proj.bias, None if bias is None else bias[:d], "multihead_attn.in_proj_bias[q]")
            copy_parameter(block.cross_attn.kv_proj.bias, None if bias is None else bias[d:], "multihead_attn.in_proj_bias[k;v]")
        copy_parameter(block.cross_attn.o_proj.weight, ca.out_proj.weight, "multihead_attn.out_proj.weight")
        copy_parameter(block.cross_attn.o_proj.bias, ca.out_proj.bias, "multihead_attn.out_proj.bias")
        _copy_norm(block.cross_attn_residual.norm, layer.norm2, "norm2")
        _copy_norm(block.ffn_residual.norm, layer.norm3, "norm3")
    else:
        _copy_norm(block.ffn_residual.norm, layer.norm2, "norm2")
    copy_parameter(block.ffn.w_in.weight, layer.linear1.weight, "linear1.weight")
    copy_parameter(block.ffn.w_in.bias, layer.linear1.bias, "linear1.bias")
    copy_parameter(block.ffn.w_out.weight, layer.linear2.weight, "linear2.weight")
    copy_parameter(block.ffn.w_out.bias, layer.linear2.bias, "linear2.bias")
    return block


def block_from_torch(layer: TorchLayer, layer_idx: int = 0, **overrides) -> Block:
    """A new `Block` with `layer`'s weights and config (`config_from_torch_layer`), in the layer's
    train/eval mode: the same function in eval mode or without dropout (the module's docstring says
    how training with dropout differs). The config is at `block.config`."""
    cfg = config_from_torch_layer(layer, **overrides)
    block = Block(cfg, layer_idx, span="global", cross=isinstance(layer, nn.TransformerDecoderLayer))
    block.config = cfg
    load_torch_layer(block, layer)
    return block.train(layer.training)


def run_block(
    block: Block,
    x: torch.Tensor,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
    memory: torch.Tensor | None = None,
    memory_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one block on batch-first `x` (B, T, d) the way a `Stack` would, without embeddings
    or positions. Masks are (B, T) with True at *real* tokens (the inverse of torch's
    key_padding_mask); `causal=True` is torch's square subsequent mask."""
    positions = torch.arange(x.shape[1], device=x.device)
    bias, is_causal = attention_bias(positions, positions, causal=causal, key_padding_mask=padding_mask)
    memory_bias = None
    if memory is not None and memory_padding_mask is not None:
        mem_pos = torch.arange(memory.shape[1], device=x.device)
        memory_bias, _ = attention_bias(positions, mem_pos, causal=False, key_padding_mask=memory_padding_mask)
    masks = {block.attention_span: (bias.to(x.dtype) if bias is not None else None, is_causal)}
    memory_bias = memory_bias.to(x.dtype) if memory_bias is not None else None
    return block(x, StackInputs(masks, None, memory, memory_bias))


@torch.no_grad()
def rmsnorm_from_torch(norm: nn.RMSNorm) -> RMSNorm:
    """Our RMSNorm with the weight and eps of a `torch.nn.RMSNorm` (eps=None in torch means
    torch.finfo(input dtype).eps; float32's is used here). Only a 1-d normalized_shape with an
    affine weight is representable."""
    if len(norm.normalized_shape) != 1:
        raise ValueError(f"only 1-d normalized_shape is supported, got {tuple(norm.normalized_shape)}")
    dim = norm.normalized_shape[0]
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    ours = RMSNorm(dim, eps=eps)
    if norm.weight is not None:
        ours.weight.copy_(norm.weight)
    return ours
