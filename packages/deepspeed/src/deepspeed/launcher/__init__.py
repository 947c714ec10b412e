"""The ``deepspeed`` launcher: ``deepspeed.launcher.runner`` (the command), ``.launch`` (one node's ranks),
``.multinode_runner`` (pdsh/MPI/Slurm command lines) and ``.launcher_helper`` (per-rank MPI/Slurm wrapper).

Nothing here imports torch: the ranks do.
"""
