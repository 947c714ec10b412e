"""DeepCompile's constants.

AutoSP: the ``tag`` attribute values marking the inputs its graph pass shards along the sequence (set by
``passes.sp_compile.prepare_autosp_inputs``, or by hand: ``input_ids.tag = AUTOSP_INPUT_ID_KEY``); Dynamo copies
a tensor's attributes into its graph placeholder's ``meta["tensor_dict"]``, where the pass finds them.
"""

AUTOSP_INPUT_ID_KEY = "input_id"
AUTOSP_LABEL_ID_KEY = "label_id"
AUTOSP_POSITION_ID_KEY = "position_id"
