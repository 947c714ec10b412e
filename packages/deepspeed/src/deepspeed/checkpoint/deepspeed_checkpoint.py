"""``DeepSpeedCheckpoint``: a Megatron-DeepSpeed checkpoint tag folder read at a (possibly smaller) pipeline x
tensor x data layout: which model-states, layer and ZeRO files each new rank reads, and their states merged
(DeepSpeed's ``deepspeed.checkpoint.DeepSpeedCheckpoint``, used by Megatron-DeepSpeed's conversion tools and by
``ds_to_universal``).

The folder holds ``mp_rank_XX_model_states.pt`` (one per pipeline stage x tensor slice, pipeline-major),
``layer_LL-model_TT-model_states.pt`` (pipeline-parallel runs: one per layer and tensor slice; layer 0 the
embedding, the last the final norm, the rest transformer layers) and the ZeRO optimizer shards. Each
model-states file is read once at construction and only its layout metadata is kept (``model_state_metadata``),
with the first file's ``iteration``, ``args``, ``checkpoint_info`` and ``universal_checkpoint_info``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from deepspeed.checkpoint.constants import (
    AUTOEP_LAYERS_KEY,
    AUTOEP_LAYERS_KEY_LEGACY,
    AUTOEP_ZERO12_REQUIRED_FIELDS,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    LAYER_FILE_PREFIX,
    MODEL_FILE_PREFIX,
    PARAM_SHAPES,
    UNIVERSAL_CHECKPOINT_INFO,
)
from deepspeed.checkpoint.reshape_3d_utils import get_model_3d_descriptor_from_metadata, model_3d_desc
from deepspeed.checkpoint.reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from deepspeed.checkpoint.reshape_utils import (
    basic_folder_validation,
    get_files,
    get_files_with_prefix,
    get_zero_files,
    merge_state,
    partition_data,
)
from deepspeed.checkpoint.zero_checkpoint import ZeROCheckpoint

EMBEDDING_LAYER_INDEX = 0
FINAL_LAYER_NORM_INDEX = -1
ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
LAYER_FILE_PREFIX_PATTERN = r"layer_(\d+)-model_.*"
USE_DATA_BEFORE_EXPERT_PARALLELISM = "use_data_before_expert_parallelism"
AUTOEP_METADATA_FIELDS = ("moe_layer_id", "module_path", *AUTOEP_ZERO12_REQUIRED_FIELDS)

# Megatron weights every tensor slice holds whole (taken from the first slice); the rest are concatenated
SEQUENTIAL_LAYERS = [
    "input_layernorm.weight", "input_layernorm.bias", "self_attention.dense.bias", "post_attention_layernorm.weight",
    "post_attention_layernorm.bias", "mlp.dense_4h_to_h.bias", "position_embeddings.weight",
]
# row-parallel weights are split along dim 1; everything else along dim 0
LAYER_CONCAT_DIM = {"self_attention.dense.weight": 1, "mlp.dense_4h_to_h.weight": 1}


def _pipeline_layer_files(file_list: list[str]) -> list[str]:
    return sorted(path for path in file_list if re.fullmatch(LAYER_FILE_PREFIX_PATTERN, os.path.basename(path)))


def _type_name_unless(value: Any, accepted: type | tuple[type, ...]) -> Any:
    return value if value is None or isinstance(value, accepted) else type(value).__name__


class DeepSpeedCheckpoint:
    """The checkpoint tag folder ``dir`` read at ``tp_degree`` x ``pp_degree`` x ``dp_degree`` (each default:
    the layout it was written at; a smaller one merges neighbouring ranks' files)."""

    def __init__(self, dir: str | os.PathLike, tp_degree: int | None = None, pp_degree: int | None = None,  # noqa: A002
                 dp_degree: int | None = None, final_layer_norm_idx: int = FINAL_LAYER_NORM_INDEX) -> None:
        self.final_layer_norm_idx = final_layer_norm_idx
        self.dir = dir
        self.file_list = get_files(dir)
        self.layer_files = _pipeline_layer_files(self.file_list)
        self._validate_folder(dir, pipeline_parallel=bool(self.layer_files))
        self.mp_rank_files = get_files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        self.model_state_metadata, self.global_state = self._discover_model_state_metadata()
        source = get_model_3d_descriptor_from_metadata(self.file_list, get_zero_files(dir), self.model_state_metadata)
        self.zero_checkpoint = ZeROCheckpoint(dir, source_3d=source)
        self.layer_keys = self._get_layer_keys()
        self.layer_count = len(self.layer_keys)
        self.tp_degree = source.tp_degree if tp_degree is None else tp_degree
        self.pp_degree = source.pp_degree if pp_degree is None else pp_degree
        self.dp_degree = source.dp_degree if dp_degree is None else dp_degree
        self.original_world_size = source.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = meg_2d_parallel_map(source.pp_degree, source.tp_degree)
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(old_pp_degree=source.pp_degree, old_tp_degree=source.tp_degree,
                                                  new_pp_degree=self.pp_degree, new_tp_degree=self.tp_degree)
        if self.is_change_pp_degree() or self.is_change_tp_degree() or self.is_change_dp_degree():
            self.zero_checkpoint.reshape(model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree))
        self._sanity_check()
        self.pp_to_transformer_map = self._build_pp_transformer_map()
        self.transformer_file_map = self._build_transformer_file_map()
        self.tp_to_embedding_map = self._build_tp_other_layer_map(EMBEDDING_LAYER_INDEX)
        self.tp_to_final_norm_map = self._build_tp_other_layer_map(self.final_layer_norm_idx)

    # ---- what is kept of each model-states file
    @staticmethod
    def _lightweight_autoep_metadata(model_state: dict[str, Any]) -> Any:
        layers = model_state.get(AUTOEP_LAYERS_KEY)
        if layers is None:
            layers = model_state.get(AUTOEP_LAYERS_KEY_LEGACY)
        if not isinstance(layers, list):
            return _type_name_unless(layers, list)
        return [{key: entry[key] for key in AUTOEP_METADATA_FIELDS if key in entry} if isinstance(entry, dict)
                else type(entry).__name__ for entry in layers]

    @staticmethod
    def _lightweight_ds_config(model_state: dict[str, Any]) -> Any:
        config = model_state.get("ds_config", {})
        if not isinstance(config, dict):
            return type(config).__name__
        ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        return {USE_DATA_BEFORE_EXPERT_PARALLELISM: ordering if isinstance(ordering, bool) else type(ordering).__name__}

    @staticmethod
    def _lightweight_param_shapes(model_state: dict[str, Any]) -> Any:
        shapes = model_state.get(PARAM_SHAPES)
        if not isinstance(shapes, (list, tuple)) or not all(isinstance(group, dict) for group in shapes):
            return _type_name_unless(shapes, ())
        return {name: shape for group in shapes for name, shape in group.items()}

    @staticmethod
    def _lightweight_parallel_dimensions(model_state: dict[str, Any]) -> Any:
        dimensions = model_state.get(CHECKPOINT_PARALLEL_DIMS)
        if not isinstance(dimensions, dict):
            return _type_name_unless(dimensions, dict)
        return {key: dimensions.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}

    def _discover_model_state_metadata(self) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
        """Read each model-states file once; keep its layout metadata and the first file's global values."""
        metadata, global_state = [], {}
        for index, model_file in enumerate(self.mp_rank_files):
            state = torch.load(model_file, map_location=torch.device("cpu"), weights_only=False)
            metadata.append((model_file, {
                CHECKPOINT_PARALLEL_DIMS: self._lightweight_parallel_dimensions(state),
                PARAM_SHAPES: self._lightweight_param_shapes(state),
                AUTOEP_LAYERS_KEY: self._lightweight_autoep_metadata(state),
                "ds_config": self._lightweight_ds_config(state),
            }))
            if index == 0:
                global_state[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
                for key in (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO):
                    global_state[key] = state.get(key)
            del state
        return metadata, global_state

    # ---- layout
    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    def show_2d_mapping(self) -> None:
        print("reshaped 2d map ---- begin")
        for i in range(self.pp_degree):
            for j in range(self.tp_degree):
                print(f"[{i}, {j}] = {self.get_2d_parallel_files(pp_index=i, tp_index=j)}")
        print("reshaped 2d map ---- end")

    def show_tp_embedding_map(self) -> None:
        self._dump_mapping(self.tp_to_embedding_map, "tp_to_embedding_layers")

    def show_tp_final_norm_map(self) -> None:
        self._dump_mapping(self.tp_to_final_norm_map, "tp_to_final_norm_layers")

    def show_pp_transformer_map(self) -> None:
        self._dump_mapping(self.pp_to_transformer_map, "pp_to_transformer_layers")

    def show_transformer_file_map(self) -> None:
        self._dump_mapping(self.transformer_file_map, "rank_to_transformer_files")

    # ---- ZeRO shards
    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int,
                                  strip_tensor_paddings: bool = True) -> dict[str, Any] | None:
        return self.zero_checkpoint.get_state_for_rank(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index,
                                                       keys_to_ignore=[PARAM_SHAPES],
                                                       strip_tensor_paddings=strip_tensor_paddings)

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return self.zero_checkpoint.get_files_for_rank(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index)

    # ---- global values of the first model-states file
    def _get_checkpoint_value(self, key: str) -> Any:
        if key not in self.global_state:
            state = torch.load(self.mp_rank_files[0], map_location=torch.device("cpu"), weights_only=False)
            self.global_state[key] = state.get(key)
        return self.global_state[key]

    def get_iteration(self) -> int:
        if ITERATION_KEY not in self.global_state:
            state = torch.load(self.mp_rank_files[0], map_location=torch.device("cpu"), weights_only=False)
            self.global_state[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
        return self.global_state[ITERATION_KEY]

    def get_args(self) -> Any:
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY) -> Any:
        return self._get_checkpoint_value(info_key)

    # ---- model states and pipeline layers at the new layout
    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list[str]:
        self._check_position(tp_index, pp_index)
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> dict[str, Any] | None:
        """The model-states files of new position ``(tp, pp)`` merged (``merge_state``)."""
        merged = None
        for path in self.get_2d_parallel_files(tp_index=tp_index, pp_index=pp_index):
            state = torch.load(path, map_location=torch.device("cpu"), weights_only=False)
            merged = state if merged is None else merge_state(merged, state)
        return merged

    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_files(self, tp_index: int) -> list[str]:
        self._check_known(self.tp_to_embedding_map, tp_index, "embedding")
        return self.tp_to_embedding_map[tp_index]

    def get_embedding_state(self, tp_index: int) -> dict[str, Any]:
        return self._merge_state_dicts([self._load(path) for path in self.get_embedding_files(tp_index)])

    def get_final_norm_files(self, tp_index: int) -> list[str]:
        self._check_known(self.tp_to_final_norm_map, tp_index, "final norm")
        return self.tp_to_final_norm_map[tp_index]

    def get_final_norm_state(self, tp_index: int) -> dict[str, Any]:
        return self._load(self.get_final_norm_files(tp_index)[0])  # a norm is whole on every slice

    def get_pp_transformer_map(self, pp_index: int) -> list[str]:
        self._check_position(0, pp_index)
        return self.pp_to_transformer_map[pp_index]

    def get_transformer_state(self, tp_index: int, pp_index: int) -> list[dict[str, Any]]:
        """Each transformer layer of new position ``(tp, pp)``: its tensor slices' weights merged."""
        self._check_position(tp_index, pp_index)
        return [self._merge_state_dicts([self._load(path) for path in paths])
                for paths in self.transformer_file_map[(tp_index, pp_index)]]

    def validate_files(self) -> None:
        for path in self.file_list:
            if not os.path.isfile(path):
                print(f"Error: {path} is not existent")

    # ---- construction helpers
    @staticmethod
    def _load(path: str) -> dict[str, Any]:
        return torch.load(path, map_location=torch.device("cpu"), weights_only=False)

    def _check_position(self, tp_index: int, pp_index: int) -> None:
        if not (0 <= tp_index < self.tp_degree and 0 <= pp_index < self.pp_degree):
            raise AssertionError(f"(tp_index, pp_index) = ({tp_index}, {pp_index}) is outside the layout "
                                 f"tp_degree={self.tp_degree}, pp_degree={self.pp_degree}")

    @staticmethod
    def _check_known(mapping: dict[int, list[str]], tp_index: int, what: str) -> None:
        if tp_index not in mapping:
            raise AssertionError(f"no {what} layer files for tp_index {tp_index} (known: {sorted(mapping)})")

    def _build_tp_other_layer_map(self, layer_index: int) -> dict[int, list[str]]:
        if not self.layer_files:
            return {}
        files = get_files_with_prefix(self.layer_files, self.layer_keys[layer_index] + "-")
        return {i: list(part) for i, part in enumerate(partition_data(files, self.tp_degree))}

    def _transformer_layer_keys(self) -> list[str]:
        return self.layer_keys[1:self.final_layer_norm_idx]

    def _build_pp_transformer_map(self) -> dict[int, list[str]]:
        layers = self._transformer_layer_keys()
        per_stage = len(layers) // self.pp_degree if self.pp_degree > 0 else 0
        return {i: layers[i * per_stage:(i + 1) * per_stage] for i in range(self.pp_degree)}

    def _build_transformer_file_map(self) -> dict[tuple[int, int], list[list[str]]]:
        layers = self._transformer_layer_keys()
        per_stage = max(1, len(layers) // self.pp_degree) if self.pp_degree > 0 else 1
        file_map: dict[tuple[int, int], list[list[str]]] = {}
        for index, layer_key in enumerate(layers):
            slices = partition_data(get_files_with_prefix(self.layer_files, layer_key + "-"), self.tp_degree)
            for tp_index in range(self.tp_degree):
                file_map.setdefault((tp_index, index // per_stage), []).append(list(slices[tp_index]))
        return file_map

    def _sanity_check(self) -> None:
        files = self.zero_checkpoint.num_files
        if len(self.mp_rank_files) % self.tp_degree or files % (self.pp_degree * self.tp_degree):
            raise AssertionError(f"{self.dir}: {len(self.mp_rank_files)} model-states and {files} ZeRO files do not "
                                 f"fit tp_degree={self.tp_degree} x pp_degree={self.pp_degree}")

    def _get_layer_keys(self) -> list[str]:
        ids = {re.search(LAYER_FILE_PREFIX_PATTERN, os.path.basename(path)).group(1) for path in self.layer_files}
        return [f"{LAYER_FILE_PREFIX}{layer_id}" for layer_id in sorted(ids, key=int)]

    @staticmethod
    def _merge_state_dicts(sd_list: list[dict[str, Any]]) -> dict[str, Any]:
        """Tensor slices of one layer as one: concatenated along the weight's split dimension, or taken from the
        first slice for the weights every slice holds whole."""
        return {key: sd_list[0][key] if key in SEQUENTIAL_LAYERS
                else torch.cat([sd[key] for sd in sd_list], dim=LAYER_CONCAT_DIM.get(key, 0))
                for key in sd_list[0]}

    @staticmethod
    def _dump_mapping(data_map: dict[Any, Any], map_tag: str | None = None) -> None:
        if map_tag is not None:
            print(f"Dump mapping: {map_tag}")
        for key, value in data_map.items():
            print(f"{key} = {value}")

    @staticmethod
    def _validate_folder(dir: str | os.PathLike, pipeline_parallel: bool) -> None:  # noqa: A002
        basic_folder_validation(dir)
        files = get_files(dir)
        prefixes = [MODEL_FILE_PREFIX] + ([LAYER_FILE_PREFIX, f"{LAYER_FILE_PREFIX}01"] if pipeline_parallel else [])
        for prefix in prefixes:
            if not get_files_with_prefix(files, prefix):
                raise AssertionError(f"{dir} seems a bogus DeepSpeed checkpoint folder: Cannot find {prefix}* files "
                                     "in there.")
