"""``deepspeed.runtime.activation_checkpointing``: DeepSpeed's activation checkpointing API (see ``checkpointing``)."""
