"""``deepspeed.runtime.state_dict_factory``: loading Megatron tensor-parallel checkpoints at another tensor-parallel
size (DeepSpeed's ``SDLoaderFactory`` / ``MegatronSDLoader``, used by inference and Megatron-DeepSpeed's tools).

A checkpoint of ``N`` files (``mp_rank_00 .. mp_rank_{N-1}``) is read by ``M`` ranks:
- ``N == M``: rank ``r`` reads file ``r`` as it is;
- ``N > M`` (``N`` a multiple of ``M``): rank ``r`` merges files ``r*N/M .. (r+1)*N/M - 1``;
- ``N < M`` (``M`` a multiple of ``N``): rank ``r`` cuts its part out of file ``r // (M/N)``.
Megatron's column-parallel weights (``attention.query_key_value``, ``mlp.dense_h_to_4h.{weight,bias}``,
``word_embeddings.weight``; ``final_linear.weight`` when cutting) join on dim 0, its row-parallel weights
(``attention.dense.weight``, ``mlp.dense_4h_to_h.weight``) on dim 1, everything else is replicated. The fused
QKV weight's row order depends on the checkpoint version (``checkpoint_version`` in the file, or the loader's
``version``): 0 is ``[3 * np * hn, h]`` (all Q rows, then K, then V), 1.0 ``[np * hn * 3, h]`` and 2.0
``[np * 3 * hn, h]`` (per-partition blocks), so version 0 is regrouped per Q/K/V and the others join whole.
"""

from __future__ import annotations

import collections
import copy
import json
import os
from abc import ABC, abstractmethod
from typing import Any

import torch

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.weight_quantizer import WeightQuantization
from deepspeed.utils import logger

AUTO_MODULE_KEY = "auto"
_ROW_PARALLEL = ("attention.dense.weight", "mlp.dense_4h_to_h.weight")
_COLUMN_PARALLEL = ("mlp.dense_h_to_4h.weight", "word_embeddings.weight", "mlp.dense_h_to_4h.bias")
_QKV = "attention.query_key_value"
_QUANTIZED = ("attention.query_key_value.weight", "mlp.dense_h_to_4h.weight")
_VERSIONS = (0, 1.0, 2.0)


def _load(engine: Any, path: str) -> Any:
    return engine.load(path, map_location=lambda storage, loc: storage)


class SDLoaderFactory:
    """Builds the loader a checkpoint description asks for."""

    @staticmethod
    def get_sd_loader_json(json_file: str | dict, checkpoint_engine: Any) -> Any:
        """A loader for the description ``{"type", "checkpoints", "version", ...}`` (a path or a dict);
        ``bloom`` and ``ds_model`` descriptions are returned as they are (their loading is the caller's)."""
        if isinstance(json_file, str):
            with open(json_file) as f:
                data = json.load(f)
        elif isinstance(json_file, dict):
            data = json_file
        else:
            raise TypeError(f"get_sd_loader_json: json_file={type(json_file).__name__} is invalid; accepted: a path "
                            "to a JSON file or a dict")
        missing = [k for k in ("type", "checkpoints", "version") if k not in data]
        if missing:
            raise ValueError(f"get_sd_loader_json: the checkpoint description lacks {missing}; it needs 'type', "
                             "'checkpoints' (the files) and 'version'")
        if str(data["type"]).lower() in ("bloom", "ds_model"):
            return data
        return SDLoaderFactory.get_sd_loader(data["checkpoints"], checkpoint_engine, data["type"], data["version"])

    @staticmethod
    def get_sd_loader(ckpt_list: list[str], checkpoint_engine: Any, sd_type: str = "Megatron",
                      version: Any = None) -> SDLoaderBase:
        if sd_type == "Megatron":
            return MegatronSDLoader(ckpt_list, version, checkpoint_engine)
        raise ValueError(f"get_sd_loader: sd_type={sd_type!r} is not supported; accepted: 'Megatron'")


class SDLoaderBase(ABC):
    """Reads, merges or cuts the files of a tensor-parallel checkpoint for one rank."""

    def __init__(self, ckpt_list: list[str], version: Any, checkpoint_engine: Any) -> None:
        self.module_key: str | None = None
        self.ckpt_list = list(ckpt_list)
        self.version = version
        self.checkpoint_engine = TorchCheckpointEngine() if checkpoint_engine is None else checkpoint_engine
        self.check_ckpt_list()

    def load(self, mp_world_size: int, mp_rank: int, module_key: str | None = AUTO_MODULE_KEY,
             is_pipe_parallel: bool = False, quantize: bool = False, quantize_bits: int = 8,
             quantize_groups: int = 64, mlp_extra_grouping: bool = True) -> tuple[str, Any, tuple[Any, int]]:
        """``(path read, state dict for rank mp_rank of mp_world_size, (quantization scales or None,
        number of files merged))``. ``module_key``: where the weights sit in a file (``"auto"``: ``module`` or
        ``model``; None: the file is the weights). A pipeline module's ``mp_rank_*`` files (``is_pipe_parallel``
        with a ``module_key``) are read as saved; at another size every rank reads the first."""
        self.module_key = module_key
        count = len(self.ckpt_list)
        index = mp_rank * count // mp_world_size
        if is_pipe_parallel and module_key is not None and mp_world_size != count:
            mp_world_size, index = count, 0
        path = self.ckpt_list[index]
        merged = 1
        if count == mp_world_size:
            if not os.path.exists(path):
                raise FileNotFoundError(f"SDLoader.load: checkpoint file {path} does not exist")
            sd = _load(self.checkpoint_engine, path)
            scales = None
            if quantize:
                quantizer = WeightQuantization(mlp_extra_grouping=mlp_extra_grouping, mp_size=mp_world_size)
                module, scales = quantizer.sd_quantize_megatron(self.get_module(sd), quantize_bits, quantize_groups)
                sd = self.set_module(sd, module)
        elif count > mp_world_size:
            sd, scales, merged = self.merge_state_dict(mp_world_size, mp_rank, quantize, quantize_bits,
                                                       quantize_groups, mlp_extra_grouping)
        else:
            sd, scales = self.split_state_dict(mp_world_size, mp_rank, quantize, quantize_bits, quantize_groups,
                                               mlp_extra_grouping)
        return path, sd, (scales, merged)

    def get_merge_state_dicts(self, mp_world_size: int, mp_rank: int) -> list[Any]:
        count = len(self.ckpt_list)
        if count % mp_world_size:
            raise ValueError(f"cannot merge {count} checkpoint files onto {mp_world_size} ranks; accepted: a number "
                             f"of ranks that divides {count}")
        per_rank = count // mp_world_size
        mine = self.ckpt_list[per_rank * mp_rank:per_rank * (mp_rank + 1)]
        logger.info(f"mp_rank: {mp_rank}, ckpt_list: {mine}")
        return [_load(self.checkpoint_engine, path) for path in mine]

    def get_split_state_dict(self, mp_world_size: int, mp_rank: int) -> tuple[Any, int, int]:
        count = len(self.ckpt_list)
        if mp_world_size % count:
            raise ValueError(f"cannot cut {count} checkpoint files for {mp_world_size} ranks; accepted: a number of "
                             f"ranks that is a multiple of {count}")
        parts = mp_world_size // count
        index, offset = mp_rank // parts, mp_rank % parts
        logger.info(f"mp_rank: {mp_rank}, ckpt_list: {self.ckpt_list[index]}, offset: {offset}")
        return _load(self.checkpoint_engine, self.ckpt_list[index]), parts, offset

    def _choose_module_key(self, sd: dict[str, Any]) -> str:
        if "module" in sd and "model" in sd:
            raise ValueError("the checkpoint has both 'model' and 'module' keys; pass module_key= to say which")
        if "module" in sd:
            return "module"
        if "model" in sd:
            return "model"
        raise ValueError(f"the checkpoint has neither a 'model' nor a 'module' key (keys: {sorted(sd)[:8]}); pass "
                         "module_key=None when the file is the weights themselves")

    def get_module(self, sd: Any) -> Any:
        if self.module_key is None:
            return sd
        if self.module_key == AUTO_MODULE_KEY:
            return sd[self._choose_module_key(sd)]
        return sd[self.module_key]

    def set_module(self, sd: Any, module: Any) -> Any:
        if self.module_key is None:
            return module
        sd[self._choose_module_key(sd) if self.module_key == AUTO_MODULE_KEY else self.module_key] = module
        return sd

    def check_ckpt_list(self) -> None:
        if not self.ckpt_list:
            raise ValueError("SDLoader: the checkpoint file list is empty")
        sd = _load(self.checkpoint_engine, self.ckpt_list[0])
        saved = sd.get("mp_world_size") if isinstance(sd, dict) else None
        if saved is not None and saved != len(self.ckpt_list):
            raise ValueError(f"SDLoader: {len(self.ckpt_list)} checkpoint files given, but {self.ckpt_list[0]} was "
                             f"saved by mp_world_size={saved} ranks")

    @abstractmethod
    def merge_state_dict(self, mp_world_size: int, mp_rank: int, quantize: bool, quantize_bits: int, groups: int,
                         mlp_extra_grouping: bool) -> tuple[Any, Any, int]: ...

    @abstractmethod
    def split_state_dict(self, mp_world_size: int, mp_rank: int, quantize: bool, quantize_bits: int, groups: int,
                         mlp_extra_grouping: bool) -> tuple[Any, Any]: ...

    @abstractmethod
    def sanity_check(self, ckpt_file_name: str) -> None: ...


class MegatronSDLoader(SDLoaderBase):
    """Megatron-LM's GPT/BERT weight names and fused-QKV layouts (module docstring)."""

    def _version(self, ckpt_ver: Any) -> Any:
        if ckpt_ver not in _VERSIONS:
            raise ValueError(f"Megatron checkpoint version {ckpt_ver!r} is not supported; accepted: 0, 1.0, 2.0")
        return ckpt_ver

    def merge_query_key_value(self, param_list: list[torch.Tensor], ckpt_ver: Any) -> torch.Tensor:
        """The fused QKV of several tensor-parallel partitions as one."""
        if self._version(ckpt_ver) != 0:
            return torch.cat(param_list, dim=0)
        if param_list[0].shape[0] % 3:
            raise ValueError(f"version-0 QKV has {param_list[0].shape[0]} rows, not a multiple of 3")
        thirds = [torch.split(p, p.shape[0] // 3, dim=0) for p in param_list]
        return torch.cat([torch.cat([t[i] for t in thirds], dim=0) for i in range(3)], dim=0)

    def split_query_key_value(self, param: torch.Tensor, num_to_split: int, offset: int,
                              ckpt_ver: Any) -> torch.Tensor:
        """Partition ``offset`` of ``num_to_split`` of a fused QKV."""
        if self._version(ckpt_ver) != 0:
            if param.shape[0] % num_to_split:
                raise ValueError(f"QKV of {param.shape[0]} rows cannot be cut into {num_to_split} partitions")
            return torch.split(param, param.shape[0] // num_to_split, dim=0)[offset]
        if param.shape[0] % 3 or (param.shape[0] // 3) % num_to_split:
            raise ValueError(f"version-0 QKV of {param.shape[0]} rows cannot be cut into 3 x {num_to_split} parts")
        thirds = torch.split(param, param.shape[0] // 3, dim=0)
        size = thirds[0].shape[0] // num_to_split
        return torch.cat([torch.split(t, size, dim=0)[offset] for t in thirds], dim=0)

    def merge_state_dict(self, mp_world_size: int, mp_rank: int, quantize: bool = False, quantize_bits: int = 8,
                         groups: int = 64, mlp_extra_grouping: bool = True) -> tuple[Any, Any, int]:
        self.sanity_check(self.ckpt_list[0])
        sd_list = self.get_merge_state_dicts(mp_world_size, mp_rank)
        ds_sd = copy.deepcopy(sd_list[0])
        modules = [self.get_module(sd) for sd in sd_list]
        ckpt_ver = self.get_checkpoint_version(ds_sd)
        logger.info(f"checkpoint version: {ckpt_ver}")
        quantizer = WeightQuantization(mlp_extra_grouping=mlp_extra_grouping, mp_size=mp_world_size) \
            if quantize else None
        merged: collections.OrderedDict[str, Any] = collections.OrderedDict()
        for key in modules[0].keys():
            values = [m[key] for m in modules]
            if any(name in key for name in _ROW_PARALLEL):
                if quantizer is not None:
                    values = quantizer.Quantize(values, quantize_bits, groups, key=key, merge_dim=1)
                merged[key] = torch.cat(values, dim=1)
            elif _QKV in key:
                if quantizer is not None and "attention.query_key_value.weight" in key:
                    values = quantizer.Quantize(values, quantize_bits, groups, key=key)
                # quantized checkpoints keep the partitions' blocks as they are (DeepSpeed's MoQ layout)
                merged[key] = torch.cat(values, dim=0) if quantizer is not None else \
                    self.merge_query_key_value(values, ckpt_ver)
            elif any(name in key for name in _COLUMN_PARALLEL):
                if quantizer is not None and "mlp.dense_h_to_4h.weight" in key:
                    values = quantizer.Quantize(values, quantize_bits, groups, key=key)
                merged[key] = torch.cat(values, dim=0)
            else:
                merged[key] = values[0]
        ds_sd = self.set_module(ds_sd, merged)
        return ds_sd, (quantizer.merge_scales() if quantizer is not None else None), len(modules)

    def split_state_dict(self, mp_world_size: int, mp_rank: int, quantize: bool = False, quantize_bits: int = 8,
                         groups: int = 64, mlp_extra_grouping: bool = True) -> tuple[Any, Any]:
        sd, parts, offset = self.get_split_state_dict(mp_world_size, mp_rank)
        ds_sd = copy.deepcopy(sd)
        module = self.get_module(sd)
        ckpt_ver = self.get_checkpoint_version(ds_sd)
        logger.info(f"checkpoint version: {ckpt_ver}")
        quantizer = WeightQuantization(mlp_extra_grouping=mlp_extra_grouping, mp_size=mp_world_size) \
            if quantize else None
        cut: collections.OrderedDict[str, Any] = collections.OrderedDict()
        for key, value in module.items():
            quantized = quantizer is not None and any(name in key for name in (*_ROW_PARALLEL, *_QUANTIZED))
            if quantized:
                value = quantizer.Quantize([value], quantize_bits, groups, key)[0]
            if any(name in key for name in _ROW_PARALLEL):
                cut[key] = self._part(value, parts, offset, 1, key)
            elif _QKV in key:
                cut[key] = self.split_query_key_value(value, parts, offset, ckpt_ver)
            elif any(name in key for name in (*_COLUMN_PARALLEL, "final_linear.weight")):
                cut[key] = self._part(value, parts, offset, 0, key)
            else:
                cut[key] = value
        ds_sd = self.set_module(ds_sd, cut)
        return ds_sd, (quantizer.merge_scales_split(parts) if quantizer is not None else None)

    @staticmethod
    def _part(value: torch.Tensor, parts: int, offset: int, dim: int, key: str) -> torch.Tensor:
        if value.shape[dim] % parts:
            raise ValueError(f"{key}: dim {dim} of shape {tuple(value.shape)} cannot be cut into {parts} partitions")
        return torch.split(value, value.shape[dim] // parts, dim=dim)[offset]

    def sanity_check(self, ckpt_file_name: str) -> None:
        """The file holds Megatron's tensor-parallel weights (one key containing each of their names)."""
        module = self.get_module(_load(self.checkpoint_engine, ckpt_file_name))
        for name in (*_ROW_PARALLEL, _QKV, "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias"):
            if not any(name in key for key in module.keys()):
                raise ValueError(f"{ckpt_file_name}: no weight named like '{name}': not a Megatron checkpoint this "
                                 "loader can merge")

    def get_checkpoint_version(self, state_dict: dict[str, Any]) -> Any:
        return self.version if self.version is not None else state_dict.get("checkpoint_version", 0)
