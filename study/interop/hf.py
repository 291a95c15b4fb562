"""Import Hugging Face `transformers` models into our configurable transformer.

`config_from_hf(hf_config)` turns a Hugging Face config into a `ModelConfig`;
`from_hf(hf_model)` builds our model from it and copies every weight across
(`load_hf_weights` copies into a model that already exists). Supported:

- BertModel -> EncoderModel (the MLM head keeps its initial values; there is none to copy)
- BertForMaskedLM -> EncoderModel (the pooler keeps its initial values)
- BertForPreTraining -> EncoderModel with nsp=True (MLM head, pooler and NSP head copied)
- GPT2Model, GPT2LMHeadModel -> DecoderLM
- LlamaModel, LlamaForCausalLM -> DecoderLM (an untied lm_head only comes from *ForCausalLM)
- MistralModel, MistralForCausalLM -> DecoderLM (sliding_window -> window)

The mappings (ours <- theirs):

BERT (post-LN encoder, `norm_position="post"`, `embedding_norm=True`, learned positions,
segment embeddings):
    token_embedding / encoder.type_embedding / encoder.position.table
        <- embeddings.word_embeddings / token_type_embeddings / position_embeddings
    encoder.embedding_norm                 <- embeddings.LayerNorm
    blocks[i].self_attn.qkv_proj           <- cat[attention.self.query; key; value] (rows)
    blocks[i].self_attn.o_proj             <- attention.output.dense
    blocks[i].self_attn_residual.norm      <- attention.output.LayerNorm  (Norm(x + Attn(x)))
    blocks[i].ffn.w_in / w_out             <- intermediate.dense / output.dense
    blocks[i].ffn_residual.norm            <- output.LayerNorm
    pooler                                 <- pooler.dense (tanh applied by `pooled`)
    mlm_head.dense / norm                  <- cls.predictions.transform.dense / LayerNorm
    mlm_head.decoder.proj                  <- cls.predictions.decoder (weight tied to the word
                                              embeddings when tie_word_embeddings; its bias is
                                              the output-only vocabulary bias)
    nsp_head                               <- cls.seq_relationship

GPT-2 (pre-LN decoder with a final LayerNorm, learned positions, tied output). GPT-2's
`Conv1D` stores weights as (in, out), the transpose of `nn.Linear`, so every one is
transposed on copy; `c_attn` is already fused with columns [q | k | v]:
    token_embedding / decoder.position.table <- wte / wpe
    blocks[i].self_attn_residual.norm      <- h[i].ln_1
    blocks[i].self_attn.qkv_proj           <- h[i].attn.c_attn (transposed)
    blocks[i].self_attn.o_proj             <- h[i].attn.c_proj (transposed)
    blocks[i].ffn_residual.norm            <- h[i].ln_2
    blocks[i].ffn.w_in / w_out             <- h[i].mlp.c_fc / c_proj (transposed)
    decoder.final_norm                     <- ln_f

Llama / Mistral (pre-RMSNorm decoder, RoPE in the half-split layout both use, SwiGLU, GQA):
    token_embedding                        <- model.embed_tokens
    blocks[i].self_attn_residual.norm      <- layers[i].input_layernorm
    blocks[i].self_attn.qkv_proj           <- cat[q_proj; k_proj; v_proj] (rows; k and v have
                                              n_kv_heads * head_dim rows each)
    blocks[i].self_attn.o_proj             <- layers[i].self_attn.o_proj
    blocks[i].ffn_residual.norm            <- layers[i].post_attention_layernorm
    blocks[i].ffn.w_in                     <- cat[mlp.gate_proj; mlp.up_proj] (rows; gate first)
    blocks[i].ffn.w_out                    <- mlp.down_proj
    decoder.final_norm                     <- model.norm
    lm_head.proj                           <- lm_head (unless tie_word_embeddings)
Mistral's `sliding_window` W becomes our `window` W on every layer: both let query i see
key j iff 0 <= i - j < W.

Anything whose computation we do not model raises `UnsupportedHFModel` rather than
importing silently wrong: RoPE scaling (`rope_scaling` / a non-default `rope_parameters`
type) or partial rotary, BERT relative position embeddings, decoder / cross-attention BERT,
GPT-2 without score scaling or with per-layer scaling, cross-attention GPT-2, Llama with
attention_bias != mlp_bias, and activations we have no registry entry for. Dropout
probabilities are carried over as far as our two knobs allow (hidden and attention); they do
not affect eval-mode outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from study.config.model import ModelConfig
from study.interop.torch_nn import copy_parameter
from study.model.transformer import DecoderLM, EncoderModel, TransformerBase, build_model

__all__ = ["UnsupportedHFModel", "config_from_hf", "from_hf", "load_hf_weights", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("bert", "gpt2", "llama", "mistral")


class UnsupportedHFModel(ValueError):
    """The Hugging Face model type, class or a config feature has no faithful equivalent here."""


# HF ACT2FN names -> our activation registry names.
_PLAIN_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
# for gated MLPs (Llama family): act(gate) * up
_GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}


def _activation(name: Any, table: dict[str, str], model_type: str) -> str:
    if not isinstance(name, str) or name not in table:
        raise UnsupportedHFModel(
            f"{model_type}: activation {name!r} is not supported; supported: {sorted(table)}"
        )
    return table[name]


def _rope_theta(hf_config) -> float:
    """rope_theta from a Llama-family config, refusing any RoPE variant we do not implement.

    transformers >= 5 keeps RoPE settings in `rope_parameters` ({"rope_type", "rope_theta", ...});
    older versions have `rope_theta` plus an optional `rope_scaling` dict.
    """
    mt = hf_config.model_type
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers < 5
        scaling = getattr(hf_config, "rope_scaling", None)
        if scaling:
            raise UnsupportedHFModel(f"{mt}: rope_scaling={scaling!r} is not supported (only plain RoPE is modelled)")
        theta = getattr(hf_config, "rope_theta", 10000.0)
        partial = getattr(hf_config, "partial_rotary_factor", 1.0)
    else:
        params = dict(params)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedHFModel(
                f"{mt}: rope scaling (rope_type={rope_type!r}, rope_parameters={params!r}) is not supported; "
                "only plain RoPE (rope_type='default') is modelled"
            )
        extra = set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
        if extra:
            raise UnsupportedHFModel(f"{mt}: rope_parameters keys {sorted(extra)} are not supported")
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedHFModel(f"{mt}: partial_rotary_factor={partial} is not supported (RoPE rotates every dimension)")
    return float(theta)


def _bert_fields(c) -> dict[str, Any]:
    if getattr(c, "is_decoder", False) or getattr(c, "add_cross_attention", False):
        raise UnsupportedHFModel("bert: is_decoder / add_cross_attention BERT is not supported (encoder only)")
    pos = getattr(c, "position_embedding_type", "absolute")
    if pos not in (None, "absolute"):
        raise UnsupportedHFModel(f"bert: position_embedding_type={pos!r} is not supported (only 'absolute')")
    return dict(
        arch="encoder",
        objective="mlm",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        d_ff=c.intermediate_size,
        max_seq_len=c.max_position_embeddings,
        norm="layernorm",
        norm_eps=c.layer_norm_eps,
        norm_position="post",
        embedding_norm=True,
        position="learned",
        activation=_activation(c.hidden_act, _PLAIN_ACTIVATIONS, "bert"),
        dropout=float(c.hidden_dropout_prob),
        attention_dropout=float(c.attention_probs_dropout_prob),
        bias=True,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        type_vocab_size=c.type_vocab_size,
        pad_token_id=c.pad_token_id if c.pad_token_id is not None and c.pad_token_id < c.vocab_size else 0,
        init_std=c.initializer_range,
    )


def _gpt2_fields(c) -> dict[str, Any]:
    if not getattr(c, "scale_attn_weights", True):
        raise UnsupportedHFModel("gpt2: scale_attn_weights=False is not supported (we always scale by 1/sqrt(d_head))")
    if getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise UnsupportedHFModel("gpt2: scale_attn_by_inverse_layer_idx=True is not supported")
    if getattr(c, "add_cross_attention", False):
        raise UnsupportedHFModel("gpt2: add_cross_attention=True is not supported")
    return dict(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.n_embd,
        n_layers=c.n_layer,
        n_heads=c.n_head,
        d_ff=c.n_inner if c.n_inner is not None else 4 * c.n_embd,
        max_seq_len=c.n_positions,
        norm="layernorm",
        norm_eps=c.layer_norm_epsilon,
        norm_position="pre",
        position="learned",
        activation=_activation(c.activation_function, _PLAIN_ACTIVATIONS, "gpt2"),
        dropout=float(c.resid_pdrop),
        attention_dropout=float(c.attn_pdrop),
        bias=True,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        init_std=c.initializer_range,
    )


def _llama_fields(c) -> dict[str, Any]:
    mt = c.model_type
    attn_bias, mlp_bias = bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))
    if attn_bias != mlp_bias:
        raise UnsupportedHFModel(
            f"{mt}: attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported (our `bias` covers both)"
        )
    n_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_heads
    pad = c.pad_token_id if c.pad_token_id is not None and c.pad_token_id < c.vocab_size else 0
    fields = dict(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        d_ff=c.intermediate_size,
        max_seq_len=c.max_position_embeddings,
        norm="rmsnorm",
        norm_eps=c.rms_norm_eps,
        norm_position="pre",
        position="rope",
        rope_theta=_rope_theta(c),
        activation=_activation(c.hidden_act, _GATED_ACTIVATIONS, mt),
        dropout=0.0,
        attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        bias=attn_bias,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        pad_token_id=pad,
        init_std=c.initializer_range,
    )
    if mt == "mistral":
        fields["window"] = getattr(c, "sliding_window", None)
    return fields


_FIELDS = {"bert": _bert_fields, "gpt2": _gpt2_fields, "llama": _llama_fields, "mistral": _llama_fields}


def config_from_hf(hf_config, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face config (bert, gpt2, llama, mistral).

    `overrides` replace any field afterwards (e.g. `nsp=True` for BertForPreTraining, which
    `from_hf` sets itself). Raises `UnsupportedHFModel` for other model types and for config
    features we do not model (see the module docstring).
    """
    mt = getattr(hf_config, "model_type", None)
    if mt not in _FIELDS:
        raise UnsupportedHFModel(
            f"model_type {mt!r} is not supported; supported model types: {list(SUPPORTED_MODEL_TYPES)}"
        )
    fields = _FIELDS[mt](hf_config)
    fields.update(overrides)
    return ModelConfig.from_dict(fields)


# weight copying ---------------------------------------------------------------------------


class _Copier:
    """Copies tensors into our parameters, checking shapes and recording what was set."""

    def __init__(self, model: nn.Module):
        self.names = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), name)
        self.done: set[int] = set()

    def __call__(self, dst: torch.Tensor | None, src: torch.Tensor | None, what: str) -> None:
        if copy_parameter(dst, src, what, missing_error=UnsupportedHFModel):
            self.done.add(id(dst))

    def linear(self, ours: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None, what: str) -> None:
        self(ours.weight, weight, f"{what}.weight")
        self(ours.bias, bias, f"{what}.bias")

    def norm(self, ours: nn.Module, theirs: nn.Module, what: str) -> None:
        self(ours.weight, theirs.weight, f"{what}.weight")
        self(getattr(ours, "bias", None), getattr(theirs, "bias", None), f"{what}.bias")

    def missing(self) -> list[str]:
        return sorted(name for pid, name in self.names.items() if pid not in self.done)


def _cat_bias(*linears: nn.Linear) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise UnsupportedHFModel("some fused projections have a bias and others not")
    return torch.cat(biases)


def _check_tied(model: TransformerBase, head: nn.Module | None, embedding: torch.Tensor, what: str) -> None:
    """Refuse an output projection that differs from the input embeddings of a model whose config ties them: ours
    would share one matrix (the embeddings) and so compute other logits than the Hugging Face model does."""
    weight = getattr(head, "weight", None)
    if not model.config.tie_embeddings or weight is None or weight.data_ptr() == embedding.data_ptr():
        return
    if not torch.equal(weight, embedding):
        raise UnsupportedHFModel(f"{what}: tie_word_embeddings=True but the output projection differs from the "
                                 "input embeddings; set tie_word_embeddings=False to import both")


def _paired_blocks(ours: nn.ModuleList, theirs: nn.ModuleList, what: str):
    """(our block, theirs) for every layer; a different number of layers is refused (zip would import the first
    layers and leave the rest as they were initialised, with nothing reported missing)."""
    if len(ours) != len(theirs):
        raise UnsupportedHFModel(f"{what}: the Hugging Face model has {len(theirs)} layers and ours {len(ours)}; "
                                 "build ours with its n_layers (an override may not change the depth)")
    return zip(ours, theirs)


def _load_bert(model: EncoderModel, hf, copy: _Copier) -> None:
    bert = getattr(hf, "bert", hf)
    emb = bert.embeddings
    enc = model.encoder
    copy(model.token_embedding.weight, emb.word_embeddings.weight, "embeddings.word_embeddings.weight")
    copy(enc.position.table.weight, emb.position_embeddings.weight, "embeddings.position_embeddings.weight")
    copy(enc.type_embedding.weight, emb.token_type_embeddings.weight, "embeddings.token_type_embeddings.weight")
    copy.norm(enc.embedding_norm, emb.LayerNorm, "embeddings.LayerNorm")
    for i, (ours, theirs) in enumerate(_paired_blocks(enc.blocks, bert.encoder.layer, "bert")):
        p = f"encoder.layer.{i}"
        sa = theirs.attention.self
        copy.linear(
            ours.self_attn.qkv_proj,
            torch.cat([sa.query.weight, sa.key.weight, sa.value.weight]),
            _cat_bias(sa.query, sa.key, sa.value),
            f"{p}.attention.self.[query;key;value]",
        )
        out = theirs.attention.output
        copy.linear(ours.self_attn.o_proj, out.dense.weight, out.dense.bias, f"{p}.attention.output.dense")
        copy.norm(ours.self_attn_residual.norm, out.LayerNorm, f"{p}.attention.output.LayerNorm")
        copy.linear(ours.ffn.w_in, theirs.intermediate.dense.weight, theirs.intermediate.dense.bias, f"{p}.intermediate.dense")
        copy.linear(ours.ffn.w_out, theirs.output.dense.weight, theirs.output.dense.bias, f"{p}.output.dense")
        copy.norm(ours.ffn_residual.norm, theirs.output.LayerNorm, f"{p}.output.LayerNorm")
    if getattr(bert, "pooler", None) is not None:
        copy.linear(model.pooler, bert.pooler.dense.weight, bert.pooler.dense.bias, "pooler.dense")
    cls = getattr(hf, "cls", None)
    predictions = getattr(cls, "predictions", None)
    if predictions is not None:
        t = predictions.transform
        copy.linear(model.mlm_head.dense, t.dense.weight, t.dense.bias, "cls.predictions.transform.dense")
        copy.norm(model.mlm_head.norm, t.LayerNorm, "cls.predictions.transform.LayerNorm")
        dec = predictions.decoder
        # the bias the forward pass really adds; HF ties it to `predictions.bias`
        bias = dec.bias if dec.bias is not None else predictions.bias
        proj = model.mlm_head.decoder.proj
        _check_tied(model, dec, emb.word_embeddings.weight, "bert")
        copy(proj.weight, dec.weight, "cls.predictions.decoder.weight")
        copy(proj.bias, bias, "cls.predictions.decoder.bias")
    seq = getattr(cls, "seq_relationship", None)
    if seq is not None:
        if model.nsp_head is None:
            raise ValueError("the Hugging Face model has an NSP head; build ours with nsp=True")
        copy.linear(model.nsp_head, seq.weight, seq.bias, "cls.seq_relationship")


def _load_gpt2(model: DecoderLM, hf, copy: _Copier) -> None:
    tr = getattr(hf, "transformer", hf)
    dec = model.decoder
    copy(model.token_embedding.weight, tr.wte.weight, "wte.weight")
    copy(dec.position.table.weight, tr.wpe.weight, "wpe.weight")
    for i, (ours, theirs) in enumerate(_paired_blocks(dec.blocks, tr.h, "gpt2")):
        p = f"h.{i}"
        # Conv1D: y = x @ W + b with W of shape (in, out) -> nn.Linear weight is W.T
        copy.norm(ours.self_attn_residual.norm, theirs.ln_1, f"{p}.ln_1")
        copy.linear(ours.self_attn.qkv_proj, theirs.attn.c_attn.weight.t(), theirs.attn.c_attn.bias, f"{p}.attn.c_attn")
        copy.linear(ours.self_attn.o_proj, theirs.attn.c_proj.weight.t(), theirs.attn.c_proj.bias, f"{p}.attn.c_proj")
        copy.norm(ours.ffn_residual.norm, theirs.ln_2, f"{p}.ln_2")
        copy.linear(ours.ffn.w_in, theirs.mlp.c_fc.weight.t(), theirs.mlp.c_fc.bias, f"{p}.mlp.c_fc")
        copy.linear(ours.ffn.w_out, theirs.mlp.c_proj.weight.t(), theirs.mlp.c_proj.bias, f"{p}.mlp.c_proj")
    copy.norm(dec.final_norm, tr.ln_f, "ln_f")
    head = getattr(hf, "lm_head", None)
    _check_tied(model, head, tr.wte.weight, "gpt2")
    if head is not None and not model.config.tie_embeddings:
        copy.linear(model.lm_head.proj, head.weight, head.bias, "lm_head")


def _load_llama(model: DecoderLM, hf, copy: _Copier) -> None:
    base = getattr(hf, "model", hf)
    dec = model.decoder
    copy(model.token_embedding.weight, base.embed_tokens.weight, "embed_tokens.weight")
    for i, (ours, theirs) in enumerate(_paired_blocks(dec.blocks, base.layers, "llama")):
        p = f"layers.{i}"
        at, mlp = theirs.self_attn, theirs.mlp
        copy.norm(ours.self_attn_residual.norm, theirs.input_layernorm, f"{p}.input_layernorm")
        copy.linear(
            ours.self_attn.qkv_proj,
            torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]),
            _cat_bias(at.q_proj, at.k_proj, at.v_proj),
            f"{p}.self_attn.[q;k;v]_proj",
        )
        copy.linear(ours.self_attn.o_proj, at.o_proj.weight, at.o_proj.bias, f"{p}.self_attn.o_proj")
        copy.norm(ours.ffn_residual.norm, theirs.post_attention_layernorm, f"{p}.post_attention_layernorm")
        copy.linear(
            ours.ffn.w_in,
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            _cat_bias(mlp.gate_proj, mlp.up_proj),
            f"{p}.mlp.[gate;up]_proj",
        )
        copy.linear(ours.ffn.w_out, mlp.down_proj.weight, mlp.down_proj.bias, f"{p}.mlp.down_proj")
    copy.norm(dec.final_norm, base.norm, "norm")
    head = getattr(hf, "lm_head", None)
    _check_tied(model, head, base.embed_tokens.weight, hf.config.model_type)
    if head is not None and not model.config.tie_embeddings:
        copy.linear(model.lm_head.proj, head.weight, head.bias, "lm_head")


_LOADERS = {"bert": _load_bert, "gpt2": _load_gpt2, "llama": _load_llama, "mistral": _load_llama}
_CLASSES = {
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "BertForPreTraining": "bert",
    "GPT2Model": "gpt2",
    "GPT2LMHeadModel": "gpt2",
    "LlamaModel": "llama",
    "LlamaForCausalLM": "llama",
    "MistralModel": "mistral",
    "MistralForCausalLM": "mistral",
}


def _model_type(hf_model) -> str:
    cls = type(hf_model).__name__
    if cls not in _CLASSES:
        raise UnsupportedHFModel(f"{cls} is not supported; supported classes: {sorted(_CLASSES)}")
    mt = _CLASSES[cls]
    if hf_model.config.model_type != mt:
        raise UnsupportedHFModel(f"{cls} has model_type {hf_model.config.model_type!r}, expected {mt!r}")
    return mt


@torch.no_grad()
def load_hf_weights(model: TransformerBase, hf_model) -> list[str]:
    """Copy the weights of `hf_model` into our `model` (built from `config_from_hf` of its
    config). Returns the names of our parameters left untouched because the Hugging Face
    model has no counterpart (e.g. the MLM head when importing a bare BertModel); empty when
    everything was copied."""
    mt = _model_type(hf_model)
    copy = _Copier(model)
    _LOADERS[mt](model, hf_model, copy)
    return copy.missing()


def from_hf(hf_model, **overrides: Any) -> TransformerBase:
    """Our model with the architecture and weights of a Hugging Face model (see the module
    docstring for the classes and mappings), in the same train/eval mode. `overrides` change
    config fields that do not affect the weights' shapes (e.g. dropout).

    The names of our parameters that had no Hugging Face counterpart are stored on the
    returned model as `hf_missing` (empty for *ForPreTraining / *LMHeadModel / *ForCausalLM).
    """
    _model_type(hf_model)  # an unsupported class fails here, before any weights are built
    if type(hf_model).__name__ == "BertForPreTraining":
        overrides.setdefault("nsp", True)
    cfg = config_from_hf(hf_model.config, **overrides)
    model = build_model(cfg)
    model.hf_missing = load_hf_weights(model, hf_model)
    return model.train(hf_model.training)
