"""zero_to_fp32 reads DeepSpeed's pickled classes as inert placeholders, except those the process already allows
in weights-only loads (deepspeed's checkpointing allows its loss scalers): those load as the real classes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FIXTURE = (Path(__file__).parent / "fixtures" / "deepspeed_0_19_8" / "stage1_fp32" / "global_step3"
           / "zero_pp_rank_0_mp_rank_00_optim_states.pt")

_PROBE = """
import sys
if sys.argv[2] == "allowed":
    import deepspeed.runtime.checkpointing.serialize
from ds_zero.zero_to_fp32 import load_checkpoint_file as _load
print(type(_load(sys.argv[1])["optimizer_state_dict"]["loss_scaler"]).__name__)
"""


def _scaler_class(mode: str) -> str:
    # a fresh interpreter each: add_safe_globals is process-wide, so the order of imports is the subject
    done = subprocess.run([sys.executable, "-c", _PROBE, str(FIXTURE), mode], capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.strip().splitlines()[-1]


def test_allowed_loss_scaler_loads_as_the_real_class():
    assert _scaler_class("allowed") == "LossScaler"


def test_without_deepspeed_the_loss_scaler_is_a_placeholder():
    assert _scaler_class("alone") == "_Placeholder"
