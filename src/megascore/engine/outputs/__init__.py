"""What the head makes of the final hidden states: the output head over the table, logprobs
and top-k, MoE / MTP metrics, routing record and replay, the head's scratch buffers.
"""
