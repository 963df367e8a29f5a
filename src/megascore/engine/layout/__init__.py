"""What a step computes where: THD packing and CP shards, shared-prefix segments and their
tree, the microbatch plan and each microbatch's packing.
"""
