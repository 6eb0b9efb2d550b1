"""Explicit plans installed on a trunk, for tests that choose the cuts and regions themselves."""
from trunksplit.chains.blocks import expand_units
from trunksplit.planning.search import Cuts, peak_model, plan_from_cuts


def _with_plan(trunk, x, starts, regions):
    """Install an explicit plan (cuts and regions) for inputs like ``x``, annotated by the model."""
    model = peak_model(trunk, x, regions=True)
    names = [n for n, _ in expand_units(trunk._blocks())]
    plan = plan_from_cuts(names, Cuts(list(starts), frozenset(regions)), trunk._ends, "budget", model)
    trunk._plans[trunk._plan_key(x)] = plan
    return plan
