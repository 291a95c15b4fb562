"""Blocks, stacks and the three model shapes (encoder, decoder, encoder-decoder).

A `Block` is self-attention [+ cross-attention] + FFN, each wrapped by the
residual recipe chosen by `norm_position`. A `Stack` embeds tokens, builds the
attention bias once per span kind ('local' / 'global') from the position scheme
and masks, and runs its blocks. The models only add heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from study.axes import ACTIVATIONS, NORM_POSITIONS, make_norm, make_position
from study.config.model import ModelConfig
from study.model.attention import Attention, KVCache, attention_bias
from study.model.ffn import FeedForward
from study.model.loss import linear_cross_entropy
from study.model.precision import autocast_dtype


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention scores will have: the autocast dtype when autocast is on."""
    return autocast_dtype(x.device.type) or x.dtype


def _to_compute_dtype(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Cast an additive bias, keeping masked entries finite (-1e9 overflows float16 to -inf)."""
    if bias is None:
        return None
    return bias.to(dtype).clamp(min=torch.finfo(dtype).min)


@dataclass
class StackInputs:
    """What every block of one forward pass shares."""

    masks: dict[str, tuple[torch.Tensor | None, bool]]  # span -> (bias, is_causal)
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    memory: torch.Tensor | None = None
    memory_bias: torch.Tensor | None = None
    cache: KVCache | None = None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, span: str, cross: bool):
        super().__init__()
        residual = NORM_POSITIONS[cfg.norm_position]

        def wrap() -> nn.Module:
            return residual(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias, cfg.dropout)

        self.attention_span = span  # 'local' (sliding window) or 'global'
        self.self_attn = Attention(cfg, layer_idx, window=cfg.window if span == "local" else None)
        self.self_attn_residual = wrap()
        self.cross_attn = Attention(cfg, layer_idx, cross=True) if cross else None
        self.cross_attn_residual = wrap() if cross else None
        self.ffn = FeedForward(cfg)
        self.ffn_residual = wrap()

    def forward(self, x: torch.Tensor, inputs: StackInputs) -> torch.Tensor:
        bias, is_causal = inputs.masks[self.attention_span]
        x = self.self_attn_residual(
            x, lambda h: self.self_attn(h, bias, is_causal, rotary=inputs.rotary, cache=inputs.cache)
        )
        if self.cross_attn is not None:
            x = self.cross_attn_residual(
                x, lambda h: self.cross_attn(h, inputs.memory_bias, False, memory=inputs.memory, cache=inputs.cache)
            )
        return self.ffn_residual(x, self.ffn)


class Stack(nn.Module):
    """Embeddings -> blocks -> final norm (for pre/sandwich residuals)."""

    def __init__(self, cfg: ModelConfig, n_layers: int, causal: bool, cross: bool, token_embedding: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        self.causal = causal
        self.token_embedding = token_embedding
        self.type_embedding = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.position = make_position(cfg, causal)
        self.embedding_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias) if cfg.embedding_norm else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.attention_spans = cfg.layer_spans(n_layers)  # 'local' or 'global' per layer
        self.blocks = nn.ModuleList(Block(cfg, i, span, cross) for i, span in enumerate(self.attention_spans))
        needs_final = NORM_POSITIONS[cfg.norm_position].needs_final_norm
        self.final_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias) if needs_final else None

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        token_type_ids: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_padding_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Hidden states (B, T, d) of `input_ids` (B, T). `padding_mask`/`memory_padding_mask`: (B, T) True for real
        tokens; with a cache, `padding_mask` covers the past and the new positions."""
        start = cache.length if cache is not None else 0
        self.position.check_length(start + input_ids.shape[1])
        q_pos = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)  # (T,) absolute positions
        k_pos = torch.arange(0, start + input_ids.shape[1], device=input_ids.device) if start else q_pos  # (Tk,)
        h = self._embed(input_ids, token_type_ids, q_pos)  # (B, T, d)
        inputs = StackInputs(self._masks(start, q_pos, k_pos, padding_mask, cache, _compute_dtype(h)),
                             self.position.rotary(q_pos), memory,
                             self._memory_bias(q_pos, memory, memory_padding_mask, _compute_dtype(h)), cache)
        for block in self.blocks:
            h = block(h, inputs)  # (B, T, d)
        if cache is not None:
            cache.seen = start + input_ids.shape[1]
        if self.final_norm is not None:
            h = self.final_norm(h)
        return h

    def _embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
               q_pos: torch.Tensor) -> torch.Tensor:
        """Token (+ segment) (+ absolute position) embeddings, normalised (BERT) and dropped out: (B, T, d)."""
        cfg = self.cfg
        h = self.token_embedding(input_ids)  # (B, T, d)
        if cfg.embed_scale:
            h = h * math.sqrt(cfg.d_model)
        if self.type_embedding is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            h = h + self.type_embedding(token_type_ids)
        pe = self.position.embed(q_pos)  # (T, d) or None
        if pe is not None:
            h = h + pe.to(h.dtype)
        if self.embedding_norm is not None:
            h = self.embedding_norm(h)
        return self.dropout(h)

    def _masks(self, start: int, q_pos: torch.Tensor, k_pos: torch.Tensor, padding_mask: torch.Tensor | None,
               cache: KVCache | None, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor | None, bool]]:
        """Attention span -> (additive bias (B|1, H|1, Tq, Tk) or None, is_causal), built once per forward.
        `start`: the first query's position (q_pos[0], known on the host: reading it from q_pos would sync)."""
        masks = {}
        for span in set(self.attention_spans):
            window = self.cfg.window if span == "local" else None
            # with a cache, a sliding-window layer holds only its most recent past positions
            first = start - cache.kept(window) if cache is not None else 0
            span_k_pos = k_pos[first:]  # (Tk,)
            span_padding = padding_mask[:, first:] if padding_mask is not None else None  # (B, Tk)
            bias, is_causal = attention_bias(
                q_pos, span_k_pos, causal=self.causal, window=window, key_padding_mask=span_padding,
                position_bias=self.position.bias(q_pos, span_k_pos),  # (H, Tq, Tk) or None
            )
            masks[span] = (_to_compute_dtype(bias, dtype), is_causal)
        return masks

    @staticmethod
    def _memory_bias(q_pos: torch.Tensor, memory: torch.Tensor | None, memory_padding_mask: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor | None:
        """Cross-attention's padding bias over the encoder memory (B, 1, Tq, S), or None."""
        if memory is None or memory_padding_mask is None:
            return None
        mem_pos = torch.arange(memory.shape[1], device=memory.device)
        bias, _ = attention_bias(q_pos, mem_pos, causal=False, key_padding_mask=memory_padding_mask)
        return _to_compute_dtype(bias, dtype)


class TransformerBase(nn.Module):
    config: ModelConfig

    def _init_weights(self) -> None:
        """Normal(0, init_std) for matrices and embeddings, zero biases; residual output
        projections scaled by 1/sqrt(2 * layers) (Radford et al. 2019, GPT-2). With
        embed_scale, token embeddings start at std d^-1/2 so the scaled sum has unit
        variance (Vaswani et al. 2017), and a learned position table at that std too (fairseq's)."""
        cfg = self.config
        n_residual = 2 * (cfg.n_layers + (cfg.resolved_encoder_layers if cfg.arch == "encoder-decoder" else 0))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = cfg.init_std
                if name.endswith(("o_proj", "ffn.w_out")):
                    std = cfg.init_std / math.sqrt(n_residual)
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, cfg.init_std)
        if cfg.embed_scale:
            for module in self.modules():
                if isinstance(module, Stack):
                    nn.init.normal_(module.token_embedding.weight, 0.0, cfg.d_model**-0.5)
                    module.position.init_beside_scaled_tokens(cfg.d_model)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}  # tied weights count once
        n = sum(p.numel() for p in params.values())
        if exclude_embeddings:
            n -= sum(
                m.weight.numel() for m in {id(m): m for m in self.modules() if isinstance(m, nn.Embedding)}.values()
            )
        return n


class LMHead(nn.Module):
    """Projection to the vocabulary; shares the token embedding matrix when tied (Press & Wolf 2017)."""

    def __init__(self, cfg: ModelConfig, token_embedding: nn.Embedding, bias: bool = False):
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=bias)
        if cfg.tie_embeddings:
            self.proj.weight = token_embedding.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


class DecoderLM(TransformerBase):
    """Decoder-only causal language model (GPT-2, Llama, Mistral)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.decoder = Stack(cfg, cfg.n_layers, causal=True, cross=False, token_embedding=self.token_embedding)
        self.lm_head = LMHead(cfg, self.token_embedding)
        self._init_weights()

    def forward(
        self, input_ids: torch.Tensor, cache: KVCache | None = None, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.lm_head(self.decoder(input_ids, cache=cache, padding_mask=padding_mask))

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross-entropy, fused with the output projection so the (tokens, vocab)
        logits are never stored (study.model.loss); equal to cross_entropy(forward(x), targets)."""
        proj = self.lm_head.proj
        return linear_cross_entropy(self.decoder(input_ids), proj.weight, targets, proj.bias, ignore_index)


class MLMHead(nn.Module):
    """BERT's masked-LM head: dense + activation + norm, then the (tied) vocabulary projection with a bias (each
    bias only where `cfg.bias`: a model without biases has none in its heads either)."""

    def __init__(self, cfg: ModelConfig, token_embedding: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.activation = ACTIVATIONS[cfg.activation].fn
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.decoder = LMHead(cfg, token_embedding, bias=cfg.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.activation(self.dense(h))))


class EncoderModel(TransformerBase):
    """Bidirectional encoder with BERT's heads: MLM, and a tanh pooler over the first
    token feeding next-sentence prediction (when `nsp`) and sequence classification."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = Stack(cfg, cfg.n_layers, causal=False, cross=False, token_embedding=self.token_embedding)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.mlm_head = MLMHead(cfg, self.token_embedding)
        self.nsp_head = nn.Linear(cfg.d_model, 2, bias=cfg.bias) if cfg.nsp else None
        self._init_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.encoder(input_ids, token_type_ids=token_type_ids, padding_mask=padding_mask)

    def pooled(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, pooling: str = "cls") -> torch.Tensor:
        """BERT's tanh pooler over the first token ("cls") or over the mean of the real tokens ("mean")."""
        if pooling == "cls":
            vector = hidden[:, 0]
        elif pooling == "mean":
            if padding_mask is None:
                vector = hidden.mean(1)
            else:
                keep = padding_mask.to(hidden.dtype).unsqueeze(-1)
                vector = (hidden * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        else:
            raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}")
        return torch.tanh(self.pooler(vector))

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlm_head(hidden)

    def nsp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.nsp_head is None:
            raise ValueError("this model was built with nsp=False and has no next-sentence head")
        return self.nsp_head(self.pooled(hidden))


class SequenceClassificationHead(nn.Module):
    """Dropout + linear on a pooled representation; n_labels=1 is regression (STS-B). A bias only where `cfg.bias`,
    as in the encoder's other heads."""

    def __init__(self, cfg: ModelConfig, n_labels: int):
        super().__init__()
        self.dropout = nn.Dropout(cfg.dropout)
        self.proj = nn.Linear(cfg.d_model, n_labels, bias=cfg.bias)
        nn.init.normal_(self.proj.weight, 0.0, cfg.init_std)
        if self.proj.bias is not None:
            nn.init.zeros_(self.proj.bias)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.proj(self.dropout(pooled))


class EncoderDecoderLM(TransformerBase):
    """Sequence-to-sequence model (Vaswani et al. 2017, T5). With tie_embeddings the
    encoder, decoder and output projection share one matrix (a joint vocabulary)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        target_embedding = self.token_embedding if cfg.tie_embeddings else nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = Stack(cfg, cfg.resolved_encoder_layers, causal=False, cross=False, token_embedding=self.token_embedding)
        self.decoder = Stack(cfg, cfg.n_layers, causal=True, cross=True, token_embedding=target_embedding)
        self.lm_head = LMHead(cfg, target_embedding)
        self._init_weights()

    def encode(self, src_ids: torch.Tensor, src_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(src_ids, padding_mask=src_padding_mask)

    def decode(
        self,
        tgt_ids: torch.Tensor,
        memory: torch.Tensor,
        memory_padding_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        h = self.decoder(tgt_ids, memory=memory, memory_padding_mask=memory_padding_mask, cache=cache)
        return self.lm_head(h)

    def forward(
        self, src_ids: torch.Tensor, tgt_ids: torch.Tensor, src_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.decode(tgt_ids, self.encode(src_ids, src_padding_mask), src_padding_mask)

    def loss(
        self,
        src_ids: torch.Tensor,
        tgt_ids: torch.Tensor,
        targets: torch.Tensor,
        src_padding_mask: torch.Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """Mean cross-entropy of the target tokens, fused with the output projection so the (tokens, vocab) logits
        are never stored (study.model.loss); equal to cross_entropy(forward(src, tgt), targets, label_smoothing)."""
        memory = self.encode(src_ids, src_padding_mask)
        h = self.decoder(tgt_ids, memory=memory, memory_padding_mask=src_padding_mask)
        proj = self.lm_head.proj
        return linear_cross_entropy(h, proj.weight, targets, proj.bias, ignore_index, label_smoothing=label_smoothing)


MODELS = {"decoder": DecoderLM, "encoder": EncoderModel, "encoder-decoder": EncoderDecoderLM}


def build_model(cfg: ModelConfig) -> TransformerBase:
    return MODELS[cfg.arch](cfg)
