"""deepspeed.compression on tiny randomly initialised Hugging Face models (no download). BertModel: DeepSpeed's
documented BERT patterns for head and row pruning, redundancy_clean shrinking Q/K/V, the output projection and the
FFN with the cleaned model's outputs equal to the masked model's, weight quantization, and layer reduction from a
teacher. GPT-2: its Conv1D layers converted to Linear (same outputs) and compressed."""

from __future__ import annotations

import copy

import pytest
import torch

from deepspeed.compression import compression_scheduler, init_compression, redundancy_clean

transformers = pytest.importorskip("transformers")

HEADS, HIDDEN, FFN = 4, 32, 64


def bert(layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=HIDDEN, num_hidden_layers=layers,
                                  num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=16,
                                  attn_implementation="eager")
    return transformers.BertModel(cfg).eval()


def inputs() -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


CONFIG = {"compression_training": {
    "head_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk", "num_heads": HEADS},
        "different_groups": {"hp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.output.dense"],
                                     "related_modules": [["self.query", "self.key", "self.value"]]}}},
    "row_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "l1"},
        "different_groups": {"rp1": {"params": {"dense_ratio": 0.25}, "modules": ["intermediate.dense"],
                                     "related_modules": [["layer.\\w+.output.dense"]]}}},
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": 4},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["self.query"]}}},
}}


def test_head_and_row_pruning_clean_to_a_smaller_bert_with_the_same_outputs():
    model = bert()
    init_compression(model, CONFIG)
    compression_scheduler(model, CONFIG)  # offsets 0: every technique on
    layer = model.encoder.layer[0]
    with torch.no_grad():  # learned head scores: make the kept heads differ between layers
        layer.attention.output.dense.head_pruning_scores.copy_(torch.tensor([[3.0, 0.0, 2.0, 1.0]]))
        model.encoder.layer[1].attention.output.dense.head_pruning_scores.copy_(torch.tensor([[0.0, 1.0, 0.5, 3]]))
        masked = model(**inputs()).last_hidden_state
    redundancy_clean(model, CONFIG)
    head = HIDDEN // HEADS
    for lyr in model.encoder.layer:
        att = lyr.attention
        for proj in (att.self.query, att.self.key, att.self.value):
            assert proj.weight.shape == (2 * head, HIDDEN) and proj.bias.shape == (2 * head,)
        assert att.output.dense.weight.shape == (HIDDEN, 2 * head)
        assert att.self.num_attention_heads == 2 and att.self.all_head_size == 2 * head
        assert lyr.intermediate.dense.weight.shape == (FFN // 4, HIDDEN)
        assert lyr.output.dense.weight.shape == (HIDDEN, FFN // 4)
        # quantized weights are stored on the 8-bit grid: at most 256 values per group
        assert max(torch.unique(g).numel() for g in att.self.query.weight.reshape(4, -1)) <= 256
    # layer 0 kept heads 0 and 2: its query rows are those heads' rows of the original
    with torch.no_grad():
        cleaned = model(**inputs()).last_hidden_state
    torch.testing.assert_close(cleaned, masked, atol=2e-5, rtol=1e-4)
    params = sum(p.numel() for p in model.parameters())
    assert params < sum(p.numel() for p in bert().parameters())


def test_head_pruning_keeps_the_highest_scored_heads():
    model = bert(layers=1)
    original_q = model.encoder.layer[0].attention.self.query.weight.detach().clone()
    init_compression(model, CONFIG)
    out = model.encoder.layer[0].attention.output.dense
    with torch.no_grad():
        out.head_pruning_scores.copy_(torch.tensor([[3.0, 0.0, 2.0, 1.0]]))
    redundancy_clean(model, {"compression_training": {"head_pruning": CONFIG["compression_training"]["head_pruning"]}})
    head = HIDDEN // HEADS
    expected = torch.cat([original_q[0:head], original_q[2 * head:3 * head]])
    torch.testing.assert_close(model.encoder.layer[0].attention.self.query.weight.detach(), expected)


def test_layer_reduction_from_a_bert_teacher():
    teacher, student = bert(layers=4, seed=0), bert(layers=2, seed=1)
    cfg = {"compression_training": {"layer_reduction": {
        "enabled": True, "keep_number_layer": 2, "module_name_prefix": "encoder.layer", "teacher_layer": [1, 3],
        "other_module_name": ["embeddings", "pooler"]}}}
    init_compression(student, cfg, teacher_model=teacher)
    for s_idx, t_idx in enumerate([1, 3]):
        for (name, s_param), t_param in zip(student.encoder.layer[s_idx].named_parameters(),
                                            teacher.encoder.layer[t_idx].parameters(), strict=True):
            torch.testing.assert_close(s_param, t_param, msg=name)
    torch.testing.assert_close(student.embeddings.word_embeddings.weight, teacher.embeddings.word_embeddings.weight)
    torch.testing.assert_close(student.pooler.dense.weight, teacher.pooler.dense.weight)
    # the student computes what the teacher with only its layers 1 and 3 computes
    reduced = copy.deepcopy(teacher)
    reduced.encoder.layer = torch.nn.ModuleList([reduced.encoder.layer[1], reduced.encoder.layer[3]])
    with torch.no_grad():
        torch.testing.assert_close(student(**inputs()).last_hidden_state, reduced(**inputs()).last_hidden_state)
    # a student copied from the teacher is cut to 2 layers: its HF config says so (a rebuilt model matches)
    copied = copy.deepcopy(teacher)
    init_compression(copied, cfg, teacher_model=teacher)
    assert len(copied.encoder.layer) == copied.config.num_hidden_layers == 2
    assert teacher.config.num_hidden_layers == 4
    assert len(type(copied)(copied.config).encoder.layer) == 2


def test_gpt2_conv1d_layers_convert_to_linear_and_compress():
    from transformers.pytorch_utils import Conv1D

    from deepspeed.compression import convert_conv1d_to_linear

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                  attn_implementation="eager")
    model = transformers.GPT2Model(cfg).eval()
    ids = inputs()["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).last_hidden_state
    convert_conv1d_to_linear(model, Conv1D)
    assert not any(isinstance(m, Conv1D) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, before)
    wq = {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {"wq": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["mlp.c_fc"]}}}}}
    init_compression(model, wq)
    compression_scheduler(model, wq)
    fc = model.h[0].mlp.c_fc
    assert torch.unique(fc.compressed_weight()).numel() <= 16
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).last_hidden_state, before)  # the 4-bit weights are used
