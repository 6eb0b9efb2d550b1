"""Explicit plans installed on a trunk, for tests that choose the cuts and regions themselves."""
from trunksplit.planning.peak import PeakModel
from trunksplit.planning.profile import profile_units
from trunksplit.planning.search import Cuts, plan_from_cuts, region_spans


def _with_plan(trunk, x, starts, regions):
    """Install an explicit plan (cuts and regions) for inputs like ``x``, annotated by the model.

    Only the spans inside the chosen regions are profiled under the region policies (all of
    them would take several times as long, for annotations nobody reads)."""
    units = trunk.units
    spans = [s for s in region_spans(units) if any(a <= s[0] and s[1] <= b for a, b, _ in regions)]
    request = trunk.plan_request()
    model = PeakModel(costs=profile_units(units, x, spans), feature_units=request.feature_units, gradients=trunk.gradients, spans=spans)
    names = [n for n, _ in units]
    plan = plan_from_cuts(names, Cuts(list(starts), frozenset(regions)), request.stops, "budget", model)
    trunk.store_plan(trunk.key_for(x), plan)
    return plan
