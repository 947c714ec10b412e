"""``deepspeed.runtime.state_dict_factory``: Megatron tensor-parallel checkpoints read at another tensor-parallel
size (cut and merged back to the original), the fused-QKV layouts per checkpoint version, quantized loading, and
the errors for what cannot be read."""

from __future__ import annotations

import pytest
import torch

from deepspeed.runtime.state_dict_factory import MegatronSDLoader, SDLoaderFactory
from deepspeed.runtime.weight_quantizer import WeightQuantization

H = 8


def _megatron_module(layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {"language_model.embedding.word_embeddings.weight": torch.randn(16, H, generator=g),
          "language_model.embedding.position_embeddings.weight": torch.randn(4, H, generator=g)}
    for i in range(layers):
        p = f"language_model.transformer.layers.{i}."
        sd.update({p + "input_layernorm.weight": torch.randn(H, generator=g),
                   p + "attention.query_key_value.weight": torch.randn(3 * H, H, generator=g),
                   p + "attention.query_key_value.bias": torch.randn(3 * H, generator=g),
                   p + "attention.dense.weight": torch.randn(H, H, generator=g),
                   p + "attention.dense.bias": torch.randn(H, generator=g),
                   p + "mlp.dense_h_to_4h.weight": torch.randn(4 * H, H, generator=g),
                   p + "mlp.dense_h_to_4h.bias": torch.randn(4 * H, generator=g),
                   p + "mlp.dense_4h_to_h.weight": torch.randn(H, 4 * H, generator=g),
                   p + "mlp.dense_4h_to_h.bias": torch.randn(H, generator=g)})
    return sd


def _save(tmp_path, name: str, module: dict, **extra) -> str:
    path = str(tmp_path / name)
    torch.save({"module": module, **extra}, path)
    return path


@pytest.mark.parametrize("version", [0, 1.0, 2.0])
def test_cut_then_merge_gives_back_the_checkpoint(tmp_path, version):
    full = _megatron_module()
    one = _save(tmp_path, "mp_rank_00_model_states.pt", full, checkpoint_version=version)
    loader = SDLoaderFactory.get_sd_loader([one], None, "Megatron")
    parts = [loader.load(2, rank)[1] for rank in range(2)]
    qkv = "language_model.transformer.layers.0.attention.query_key_value.weight"
    if version == 0:  # [Q; K; V]: partition r holds its rows of each
        q, k, v = torch.split(full[qkv], H, dim=0)
        assert torch.equal(parts[0]["module"][qkv], torch.cat([q[:H // 2], k[:H // 2], v[:H // 2]]))
    else:  # per-partition blocks: partition r holds block r
        assert torch.equal(parts[1]["module"][qkv], full[qkv][3 * H // 2:])
    dense = "language_model.transformer.layers.1.attention.dense.weight"
    assert torch.equal(parts[1]["module"][dense], full[dense][:, H // 2:])  # row-parallel: dim 1
    norm = "language_model.transformer.layers.1.input_layernorm.weight"
    assert torch.equal(parts[0]["module"][norm], full[norm])  # replicated
    paths = [_save(tmp_path, f"mp_rank_{r:02d}_model_states.pt", parts[r]["module"], checkpoint_version=version,
                   mp_world_size=2) for r in range(2)]
    path, merged, (scales, count) = SDLoaderFactory.get_sd_loader(paths, None, "Megatron").load(1, 0)
    assert count == 2 and scales is None and path == paths[0]
    assert merged["module"].keys() == full.keys()
    assert all(torch.equal(merged["module"][k], full[k]) for k in full)


def test_same_size_reads_the_rank_file_and_description_json(tmp_path):
    full = _megatron_module(1)
    paths = [_save(tmp_path, f"r{r}.pt", full) for r in range(2)]
    desc = {"type": "Megatron", "checkpoints": paths, "version": 1.0}
    loader = SDLoaderFactory.get_sd_loader_json(desc, None)
    assert isinstance(loader, MegatronSDLoader)
    path, sd, _ = loader.load(2, 1)
    assert path == paths[1] and torch.equal(sd["module"]["language_model.embedding.word_embeddings.weight"],
                                            full["language_model.embedding.word_embeddings.weight"])
    assert SDLoaderFactory.get_sd_loader_json({**desc, "type": "ds_model"}, None)["type"] == "ds_model"


def test_quantized_merge_keeps_int8_weights_and_one_scale_row_per_weight(tmp_path):
    full = _megatron_module(2)
    paths = []
    for r in range(2):
        row = ("attention.dense.weight", "4h_to_h.weight")
        column = ("query_key_value", "h_to_4h", "word_embeddings")
        part = {k: (torch.split(v, v.shape[1] // 2, dim=1)[r] if any(n in k for n in row)
                    else torch.split(v, v.shape[0] // 2, dim=0)[r] if any(n in k for n in column) else v)
                for k, v in full.items()}
        paths.append(_save(tmp_path, f"q{r}.pt", part, checkpoint_version=1.0))
    _, sd, (scales, count) = SDLoaderFactory.get_sd_loader(paths, None).load(1, 0, quantize=True, quantize_groups=4)
    w = sd["module"]["language_model.transformer.layers.0.mlp.dense_4h_to_h.weight"]
    assert w.dtype == torch.int8 and w.shape == (H, 4 * H) and count == 2
    assert scales.shape[:2] == (2, 4)  # layers x (qkv, dense, h->4h, 4h->h)


def test_quantize_data_is_groupwise_symmetric_int8():
    q = WeightQuantization()
    data = torch.tensor([[0.5, -1.0, 0.25, 0.0], [2.0, 1.0, -0.5, 0.1]])
    values, scales = q.quantize_data(data, 8, 2)
    assert values.dtype == torch.int8 and scales.shape == (2, 1)
    assert torch.allclose(values.float() / scales.repeat_interleave(4, dim=0).view(2, 4), data, atol=1 / scales.min())
    assert int(values[0, 1]) == -128 and int(values[1, 0]) == 127  # each run's peak maps to the range's end
    with pytest.raises(ValueError, match="groups=0"):
        q.quantize_data(data, 8, 0)


def test_errors_name_what_cannot_be_read(tmp_path):
    full = _megatron_module(1)
    paths = [_save(tmp_path, f"e{r}.pt", full) for r in range(3)]
    loader = SDLoaderFactory.get_sd_loader(paths, None)
    with pytest.raises(ValueError, match="cannot merge 3 checkpoint files onto 2 ranks"):
        loader.load(2, 0)
    with pytest.raises(ValueError, match="sd_type='GPTNeoX' is not supported"):
        SDLoaderFactory.get_sd_loader(paths, None, "GPTNeoX")
    saved_by_4 = _save(tmp_path, "four.pt", full, mp_world_size=4)
    with pytest.raises(ValueError, match="saved by mp_world_size=4"):
        SDLoaderFactory.get_sd_loader([saved_by_4], None)
    with pytest.raises(ValueError, match="version 3 is not supported"):
        SDLoaderFactory.get_sd_loader([paths[0]], None, version=3).load(2, 0)
