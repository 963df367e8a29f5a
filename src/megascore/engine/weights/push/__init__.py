"""Weight pushes on every rank: the engine's WEIGHTS_* handlers (``handler``), the parts of
pushed tensors each rank reads (``parts``) and receives point to point (``transfer``), and
staging and applying them at the commit (``apply``)."""
