"""One cell in this process or on this rank -> records (``cell.run_cell``, by kind), never starting a
process: what it runs on (``setup``), the one measurement loop (``loop``) and its cell kinds (``single_group``,
``tree_cell``, ``parallel_step``: one rank or many),
meters (``measure``), record columns (``columns``), alignment cells and capacity-frontier searches."""
