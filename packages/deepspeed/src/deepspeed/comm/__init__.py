"""``deepspeed.comm``: DeepSpeed's communication API over ``torch.distributed`` (see ``comm.comm``)."""

from deepspeed.comm.comm import *  # noqa: F403 - the public surface is comm.__all__
from deepspeed.comm.comm import __all__  # noqa: F401
