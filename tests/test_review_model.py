"""Review round of the model, decoding and Hugging Face import: each test names a defect that was found, and fails
without its fix."""

from __future__ import annotations

import pytest
import torch

from study.config import ModelConfig
from study.model import build_model
from study.model.generate import sample

V = 50


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def tiny_decoder(**overrides):
    base = dict(arch="decoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64,
                init_std=0.15)
    base.update(overrides)
    torch.manual_seed(0)
    return build_model(ModelConfig(**base)).eval()


class CountingForward:
    """A decoder-only model that records how many tokens each forward pass was fed."""

    def __init__(self, model):
        self.model, self.fed = model, []

    def __call__(self, input_ids, cache=None):
        self.fed.append(input_ids.shape[1])
        return self.model(input_ids, cache=cache)


def test_sampling_runs_one_forward_pass_per_new_token():
    """The prompt's pass gives the first token's logits, each drawn token's pass the next one's: the last token
    drawn is never fed (a pass for it was computed and thrown away)."""
    model = CountingForward(tiny_decoder(position="rope"))
    out = sample(model, torch.randint(1, V, (2, 5)), max_new_tokens=4, temperature=0)
    assert out.shape == (2, 9)
    assert model.fed == [5, 1, 1, 1]


def test_sampling_reaches_the_end_of_a_learned_position_table():
    """With max_seq_len = 12 and a prompt of 8, the model reads positions 0..11 to predict 5 tokens, as a full
    forward of 12 tokens predicts the 13th: no position past the table is needed, so none is refused."""
    model = tiny_decoder(position="learned", max_seq_len=12)
    prompt = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(1))
    out = sample(model, prompt, max_new_tokens=5, temperature=0)
    with torch.no_grad():
        full = model(out[:, :12])  # (2, 12, V): the next-token logits after every prefix
    assert torch.equal(out[:, 8:], full[:, 7:].argmax(-1))
    with pytest.raises(ValueError, match="beyond max_seq_len=12"):  # one more would need position 12
        sample(model, prompt, max_new_tokens=6, temperature=0)


def _untie(hf_model):
    """Give a Hugging Face model whose config ties the output projection to the embeddings an output projection of
    its own (as a checkpoint loaded with tying undone would have): its logits no longer come from the embeddings."""
    head = hf_model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach() + 0.5 * torch.randn_like(head.weight))
    return hf_model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
def test_a_tied_config_over_untied_weights_is_refused_not_imported_with_other_logits(kind):
    transformers = pytest.importorskip("transformers")
    from study.interop.hf import UnsupportedHFModel, from_hf

    torch.manual_seed(0)
    small = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
    hf = {"gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
              vocab_size=61, n_positions=32, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0,
              tie_word_embeddings=True)),
          "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)),
          "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=4, **small)),
          }[kind]()
    assert from_hf(hf.eval()).config.tie_embeddings  # tied as Hugging Face builds it: imported
    with pytest.raises(UnsupportedHFModel, match="tie_word_embeddings=True but the output projection differs"):
        from_hf(_untie(hf))
