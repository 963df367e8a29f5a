"""One step on every rank: the data-parallel split, the microbatches through Megatron's
forward-only schedule, the packed model inputs, the forward step and the step's output.
"""
