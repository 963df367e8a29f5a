"""Weight pushes on every rank: staging the parts of pushed tensors each rank reads
(``parts``) and applying them at the commit (``apply``)."""
