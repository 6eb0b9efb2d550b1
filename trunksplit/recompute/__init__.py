"""How a run of modules is recomputed, with no planning.

``checkpoint.py`` runs a function under checkpointing exactly (BatchNorm once, RNG,
autocast, ``is_recomputing``); ``wrapper.py`` is ``checkpoint_wrapper``; ``select.py``
wraps the submodules a condition picks; ``regions.py`` runs a run of units under a
region policy; ``stages.py`` rebuilds a unit one convolution/matmul stage at a time.
"""
