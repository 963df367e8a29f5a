"""The served weights: the start-up model, LoadWeights reloads, and UpdateWeights pushes
(staging, parts, commit).
"""
