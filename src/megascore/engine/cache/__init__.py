"""The prefix cache: keys and values of sequence prefixes kept across requests (docs/engine.md
"Prefix cache"). Rank 0 owns the index (:mod:`.index`) and plans every step
(:mod:`.planner`); every rank keeps its own shard of the cached keys and values
(:mod:`.store`)."""
