"""Where to cut a trunk.

``vissl.py`` is vissl's bucketing (``checkpoint_trunk``); ``plan.py`` the
``SplitPlan`` every strategy returns; ``memory.py`` measures memory
(``PeakMemory``); ``profile.py`` measures each unit; ``peak.py`` predicts a
step's peak for any plan; ``templates.py`` picks regions to try (``template_scan.py``
scans them a segment at a time, as arrays); ``search.py``
finds the best plan for a segment count or a memory budget.
"""
