"""Runtime collectives beyond ``deepspeed.comm``: the 1-bit compressed all-reduce (``compressed``)."""
