"""``deepspeed.utils.tensor_fragment``: the ``fragment_address`` record ZeRO stage 1/2 optimizer files hold.

DeepSpeed pickles one per parameter under ``optimizer_state_dict['param_slice_mappings']`` (where that
parameter's piece lies in the rank's flat fp32 partition), and its universal-checkpoint converter reads their
``start`` and ``numel``. Files we write carry the same class under the same name, so that converter, and anything
else that unpickles DeepSpeed's files, reads ours unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class fragment_address:  # DeepSpeed's class name, which the pickled files refer to
    """``numel`` elements from offset ``start`` (elements) of a flat partition."""

    numel: int
    start: int
