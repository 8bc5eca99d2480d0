"""Everything about blocks with several holders, in one place: which holder of the next block gets each
micro-batch (``routing``), how a replica knows its share of a step (``shares``), parameter averaging among
the holders of one block (``averaging``), and the one object a Stage owns that ties them together
(``replica_set``)."""
