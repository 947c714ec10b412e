"""``deepspeed.checkpoint.constants``: the key strings and file-name parts of DeepSpeed's checkpoint formats.

These are file-format facts (the keys a ``*_model_states.pt`` / ``*_optim_states.pt`` / universal-checkpoint
file holds, the parts of its name), shared by the writers and readers here and by tools written for DeepSpeed,
so that a checkpoint crosses between the two both ways.
"""

# ---- keys of a ZeRO optimizer shard (zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt)
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
LOSS_SCALER = "loss_scaler"
FP32_WEIGHT_KEY = "fp32"
FP32_FLAT_GROUPS = "fp32_flat_groups"
FP32_GROUPS = "fp32_groups"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"

# ---- keys of a model-states file and of one universal-checkpoint parameter file
PARAM = "param"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
DS_VERSION = "ds_version"
VOCAB_TENSOR = "vocab_tensor"
PADDED_VOCAB_SIZE = "padded_vocab_size"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
CAT_DIM = "cat_dim"
PARAM_N_SUB_PARAMS = "param_n_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"

# ---- file names: mp_rank_00_model_states.pt, zero_pp_rank_0_mp_rank_00_optim_states.pt, layer_01-model_00-...
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"
LAYER_FILE_PREFIX = "layer_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX

# ---- the parallel layout recorded with a checkpoint
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"

# ---- universal checkpoints: the client's description of its parameters (model_state[UNIVERSAL_CHECKPOINT_INFO])
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
DS_AUTOTP_UC_META = "ds_autotp_universal_checkpoint_meta"
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"
# parameter-name regex lists under UNIVERSAL_CHECKPOINT_INFO: how each matching parameter is merged and re-split
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"  # Megatron's fused SwiGLU weights
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"
SUB_PARAMS_SHAPE = "sub_params_shape"

# ---- expert parallelism (MoE / AutoEP) metadata
AUTOEP_LAYERS_KEY = "ds_autoep_layers"
AUTOEP_LAYERS_KEY_LEGACY = "autoep_layers"
AUTOEP_EXPERT_KEY_PREFIX = "expert_key_prefix"
AUTOEP_NUM_EXPERTS = "num_experts"
AUTOEP_NUM_LOCAL_EXPERTS = "num_local_experts"
AUTOEP_EP_SIZE = "ep_size"
# the fields every AutoEP layer entry of a ZeRO-1/2 checkpoint holds (DeepSpeed reads them when converting)
AUTOEP_ZERO12_REQUIRED_FIELDS = (AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS, AUTOEP_EP_SIZE)
# ZeRO-3: the experts are saved as partitions over their expert-data-parallel group in each rank's ZeRO files
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY = "checkpoint_format"
AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT = "zero3_partitioned"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY = "checkpoint_format_version"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION = 1
EP_IS_EXPERT_PARAM = "is_expert_param"
EP_NUM_EXPERTS = "ep_num_experts"
EXPERT_PARAMETER_PATTERNS = "expert_parameter_patterns"

# ---- AutoEP folded onto AutoTP: the "folding" entry of each file a folded run saves (checkpoint.folding_metadata)
FOLDING_METADATA_KEY = "folding"
FOLDING_METADATA_VERSION = 1
FOLDING_TP_SIZE = "tp_size"
FOLDING_TP_RANK = "tp_rank"
FOLDING_EP_SIZE = "ep_size"
FOLDING_EP_RANK = "ep_rank"
FOLDING_ETP_SIZE = "etp_size"
FOLDING_ETP_RANK = "etp_rank"
FOLDING_ZERO_PARTITION_GROUP = "zero_partition_group"
FOLDING_ZERO_PARTITION_RANK = "zero_partition_rank"
FOLDING_ZERO_PARTITION_COUNT = "zero_partition_count"
FOLDING_DISPATCH_STRATEGY = "dispatch_strategy"
FOLDING_SHARED_EXPERT_PLACEMENT = "shared_expert_placement"
FOLDING_FAMILY = "family"
FOLDING_PARAM_FAMILIES = "param_families"
