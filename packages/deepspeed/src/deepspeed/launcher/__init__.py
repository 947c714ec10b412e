"""The ``deepspeed`` launcher: ``deepspeed.launcher.runner`` (the command), ``.launch`` (one node's ranks),
``.multinode_runner`` (pdsh/MPI/Slurm command lines) and ``.launcher_helper`` (per-rank MPI/Slurm wrapper).

Nothing here imports torch: the ranks do.
"""

from deepspeed.compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes, as in DeepSpeed
