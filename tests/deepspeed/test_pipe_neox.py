"""A GPT-NeoX YAML with ``pipe_parallel_size: 2`` trains a small GPT ``PipelineModule`` on 2 gloo ranks.

The YAML goes through ``ds_config.neox.load``: its ``deepspeed`` dict is the engine config (micro-batch size,
gradient accumulation, Adam, clipping, fp32), and its model arguments shape the model (``num_layers``,
``hidden_size``, ``num_attention_heads``, ``seq_length``, ``layernorm_epsilon``, ``seed``) and the pipeline the way
GPT-NeoX's ``GPT2ModelPipe`` passes them to ``PipelineModule`` (``ds_config.neox.pipeline_args``): ``num_stages`` =
``pipe_parallel_size``, ``partition_method`` = ``pipe_partition_method``, ``activation_checkpoint_interval`` =
``checkpoint_num_layers`` when ``checkpoint_activations`` (else 0), ``checkpointable_layers`` = NeoX's transformer
layer classes. The losses of ``train_batch`` on both stages equal the same model trained in one process and go down.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _harness import run_distributed
from _pipe_models import Block, Embed, lm_head, lm_loss, reference_losses

from ds_pipe import LayerSpec, TiedLayerSpec

STEPS = 3
VOCAB = 32  # no tokenizer in the test: a fixed toy vocabulary

NEOX_YML = """\
# GPT-NeoX style config: a tiny GPT, 2 pipeline stages, no tensor parallelism
pipe_parallel_size: 2
model_parallel_size: 1
pipe_partition_method: "type:transformer|mlp"

num_layers: 4
hidden_size: 16
num_attention_heads: 2
seq_length: 8
max_position_embeddings: 8
layernorm-epsilon: 1.0e-5

checkpoint_activations: true
checkpoint_num_layers: 1
partition-activations: false

train_micro_batch_size_per_gpu: 2
gradient_accumulation_steps: 2
optimizer:
  type: Adam
  params:
    lr: 0.01
gradient_clipping: 1.0
fp16:
  enabled: false
steps_per_print: 1000000
"""


class ParallelTransformerLayerPipe(Block):
    """GPT-NeoX's transformer layer class name: what ``type:transformer|mlp`` partitioning and NeoX's
    ``checkpointable_layers`` select."""


def load_neox(path: str) -> tuple[Any, list[warnings.WarningMessage]]:
    from ds_config import neox

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = neox.load(path)
    return cfg, list(caught)


def pipe_module_kwargs(cfg: Any) -> dict[str, Any]:
    """``PipelineModule`` arguments from a NeoX config, as GPT-NeoX's ``GPT2ModelPipe`` builds them."""
    from ds_config import neox

    assert cfg.model["model_parallel_size"] == 1, "tensor parallelism is not part of this test"
    return neox.pipeline_args(cfg)


def gpt_specs_from_neox(model: dict[str, Any]) -> list[Any]:
    """A GPT of the YAML's size: tied token embedding / LM head, ``num_layers`` transformer layers, final norm."""
    hidden, heads, seq = model["hidden_size"], model["num_attention_heads"], model["seq_length"]
    assert not model["no_weight_tying"]
    embed = (Embed, VOCAB, hidden, seq)
    return [TiedLayerSpec("embed", *embed, tied_weight_attr="tok.weight"),
            *[LayerSpec(ParallelTransformerLayerPipe, hidden, heads) for _ in range(model["num_layers"])],
            LayerSpec(torch.nn.LayerNorm, hidden, eps=model["layernorm_epsilon"]),
            TiedLayerSpec("embed", *embed, forward_fn=lm_head, tied_weight_attr="tok.weight")]


def token_batches(count: int, micro: int, seq: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (micro, seq + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _batches(cfg: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ds = cfg.deepspeed
    return token_batches(STEPS * ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"],
                         cfg.model["seq_length"])


def _train_from_yaml(path: str) -> dict[str, Any]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    cfg, _ = load_neox(path)
    module = PipelineModule(gpt_specs_from_neox(cfg.model), loss_fn=lm_loss, seed_layers=True,
                            **pipe_module_kwargs(cfg))
    engine, *_ = deepspeed.initialize(model=module, config=cfg.deepspeed)
    assert engine.grid.get_data_parallel_world_size() == 1
    it = iter(_batches(cfg))
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    names = [type(f).__name__ for f in engine.module.forward_funcs]
    return {"losses": losses, "stage": engine.stage_id, "parts": list(engine.module.parts), "layers": names,
            "interval": engine.module.activation_checkpoint_interval,
            "checkpointed": list(engine.module.is_checkpointable_results),
            "dtypes": sorted({str(p.dtype) for p in engine.module.parameters()})}


@pytest.fixture
def neox_yaml(tmp_path):
    path = tmp_path / "tiny_pipe.yml"
    path.write_text(NEOX_YML)
    return str(path)


def test_neox_yaml_maps_to_deepspeed_config_and_pipeline(neox_yaml):
    from ds_config._base import UnknownConfigKeyWarning

    cfg, caught = load_neox(neox_yaml)
    ds = cfg.deepspeed
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == \
        (2, 2, 1.0)
    assert ds["optimizer"] == {"type": "Adam", "params": {"lr": 0.01}} and ds["fp16"] == {"enabled": False}
    assert "pipe_parallel_size" not in ds and "checkpoint_activations" not in ds  # model arguments, not DeepSpeed's
    # `pipe_partition_method` is GPT-NeoX's own key (not in the reference table): known, so no warning
    assert not cfg.unknown_keys and not [w for w in caught if issubclass(w.category, UnknownConfigKeyWarning)]
    assert pipe_module_kwargs(cfg) == {"num_stages": 2, "partition_method": "type:transformer|mlp",
                                       "activation_checkpoint_interval": 1,
                                       "checkpointable_layers": ["ParallelTransformerLayerPipe", "GMLPBlock"],
                                       "base_seed": 1234}


def test_gpt_trains_from_neox_yaml_with_two_pipeline_stages(neox_yaml):
    got = run_distributed(_train_from_yaml, world_size=2, args=(neox_yaml,), timeout=120)
    cfg, _ = load_neox(neox_yaml)
    ds = cfg.deepspeed
    expected = reference_losses(gpt_specs_from_neox(cfg.model), _batches(cfg), lm_loss, STEPS,
                                ds["gradient_accumulation_steps"], dp=1, lr=ds["optimizer"]["params"]["lr"],
                                clip=ds["gradient_clipping"])
    for rank, r in enumerate(got):  # every stage returns the batch loss
        assert r["stage"] == rank
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        assert r["losses"][-1] < r["losses"][0]
        # type:transformer|mlp: two transformer layers per stage (embedding + 2 | 2 + norm + tied head)
        assert r["parts"] == [0, 3, 7]
        # checkpoint_activations + checkpoint_num_layers: 1 -> every transformer layer is recomputed, nothing else
        assert r["interval"] == 1
        assert r["checkpointed"] == [name == "ParallelTransformerLayerPipe" for name in r["layers"]]
        assert r["dtypes"] == ["torch.float32"]
    assert got[0]["layers"] == ["Embed", "ParallelTransformerLayerPipe", "ParallelTransformerLayerPipe"]
    assert got[1]["layers"][:3] == ["ParallelTransformerLayerPipe", "ParallelTransformerLayerPipe", "LayerNorm"]
