"""The words a plan request takes, in a module without torch: the command line offers them in its
``--help`` and checks them without importing torch (:mod:`trunksplit.cli.parser`)."""

STRATEGIES = ("vissl", "balanced")
GRADIENT_MODES = ("allocated", "kept", "in_backward")
PRICES = ("time", "flops")  # what a plan's recompute is priced in (see PeakModel.cost_key)
OBJECTIVES = ("auto",) + PRICES  # "auto": by the device the plan is for (see request.priced_in)
