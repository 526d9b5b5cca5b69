"""``rayppo.plan.flops`` against torch's own FLOP counter on a real forward pass."""

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from rayppo.models.shape import read_shape
from rayppo.plan.flops import LearnPasses, Sequences, backbone_forward_flops, learn_flops


def test_backbone_flops_match_torchs_counter(tmp_path):
    """Projections: exactly torch's matmul count. Attention (eager, since torch's counter does not
    see the CPU SDPA kernel): torch counts the full L x L score and value products, rayppo the
    causal part with the diagonal, (L + 1) / 2L of it."""
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    shape = read_shape(tmp_path)
    rows, length = 3, 20
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.model(input_ids=torch.randint(0, 97, (rows, length)))  # the decoder: no vocabulary head
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(by_op) == {"aten.mm", "aten.bmm"}  # projections, attention
    ours = backbone_forward_flops(shape, Sequences([length] * rows, 0))
    causal_attention = rows * shape.layers * 2 * length * (length + 1) * shape.heads * shape.head_dim
    assert ours - causal_attention == by_op["aten.mm"]
    assert causal_attention == by_op["aten.bmm"] * (length + 1) / (2 * length)


def test_learn_flops_count_the_head_on_response_tokens_only(tmp_path):
    """The vocabulary projection is counted for response tokens only; an epoch adds one policy
    and one critic forward + backward; pi_prox (asynchronous mode) adds one policy forward; the
    first minibatch's value forward (the experience pass's) counts once."""
    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    s = read_shape(tmp_path)
    with_responses, no_responses = Sequences([20, 20], 8), Sequences([20, 20], 0)
    head = 2 * s.hidden * s.vocab * 8
    one_epoch = LearnPasses(1, 4)
    assert learn_flops(s, s, with_responses, one_epoch) - learn_flops(s, s, no_responses, one_epoch) == 3 * head
    backbone, value_head = backbone_forward_flops(s, with_responses), 2 * s.hidden * 40
    critic = backbone + value_head
    assert learn_flops(s, s, with_responses, one_epoch) == critic + 3 * (backbone + head + critic) - critic / 4
    assert learn_flops(s, s, with_responses, LearnPasses(2, 4)) - learn_flops(s, s, with_responses, one_epoch) == \
        3 * (2 * backbone + head + value_head)
    assert learn_flops(s, s, with_responses, LearnPasses(1, 2)) - learn_flops(s, s, with_responses, one_epoch) == \
        -critic / 4
    proximal = LearnPasses(1, 4, proximal=True)
    assert learn_flops(s, s, with_responses, proximal) - learn_flops(s, s, with_responses, one_epoch) == \
        backbone + head
