"""The model runner's side of a step: the inputs of the forward pass, kept between steps.

stages 3 and 4 rebuild a step's inputs from Python lists every step (``shared/model_runner.py``
``prepare_inputs`` and stage 3's ``kv_layout``: one list element per token, the block tables
padded row by row, then ``torch.tensor``), which reads well and costs a Python loop over every
token and every block of the batch. Here each running request owns a row of preallocated
arrays that are updated in place as it joins, grows and leaves (``input_batch.py``), and a step's
token ids, positions, slot mapping and block tables are gathered from those rows with a few
array operations; ``engine_core.py`` is stage 4's engine core with that input preparation.
The packed order of the tokens is the one stage 3 uses, so the forward pass sees the same
tensors and greedy outputs stay token-identical.

This is its own room, beside ``engine/`` (the serving loop, front ends and clients, which never
look inside a step) and ``attention/`` (which reads the metadata built here), because it is
what vLLM keeps in ``vllm/v1/worker/``: ``gpu_input_batch.py`` (``InputBatch``),
``block_table.py`` (``BlockTable``) and ``gpu_model_runner.py`` (``_update_states``,
``_prepare_inputs``).
"""

from stage5_server.worker.engine_core import PersistentBatchEngineCore
from stage5_server.worker.input_batch import InputBatch

__all__ = ["InputBatch", "PersistentBatchEngineCore"]
