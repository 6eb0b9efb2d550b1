"""trunksplit's bucketing against vissl's own algorithm, and the SplitPlan value."""
import random
import warnings
from collections import OrderedDict

import pytest
import torchvision
from torch import nn

from trunksplit import checkpoint_trunk, feature_blocks, layer_splittable_before
from trunksplit.trunk import CheckpointedTrunk

from vissl_reference import vissl_checkpoint_trunk, vissl_layer_splittable_before


def _random_layer(rng, inplace_kinds):
    kind = rng.choice(["conv", "bn", "relu", "inplace", "inplace", "seq_inplace", "seq"])
    if kind == "conv":
        return nn.Conv2d(1, 1, 1)
    if kind == "bn":
        return nn.BatchNorm2d(1)
    if kind == "relu":
        return nn.ReLU()
    if kind == "seq":
        return nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU(inplace=True))
    if kind == "seq_inplace" and "seq" in inplace_kinds:
        return nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(1, 1, 1))
    return rng.choice([nn.ReLU(inplace=True)] + ([nn.SiLU(inplace=True), nn.ReLU6(inplace=True)] if "other" in inplace_kinds else []))


def _random_trunk(rng, inplace_kinds):
    blocks = OrderedDict()
    for i in range(rng.randint(1, 7)):
        if rng.random() < 0.5:
            blocks[f"res{i}"] = nn.Sequential(*[_random_layer(rng, inplace_kinds) for _ in range(rng.randint(1, 9))])
        else:
            blocks[f"b{i}"] = _random_layer(rng, inplace_kinds)
    keys = rng.sample(list(blocks), rng.randint(1, len(blocks)))
    return blocks, keys


def _cuts_before_unsplittable(buckets, predicate):
    """Whether a cut the splitter added (after an activation_split_N bucket) lands before an in-place layer.

    Cuts after requested features are the user's and are left as asked."""
    items = list(buckets.items())
    return any(prev.startswith("activation_split_") and len(seq) and not predicate(seq[0]) for (prev, _), (_, seq) in zip(items, items[1:]))


def _same(ours, theirs):
    assert list(ours) == list(theirs)
    for name in ours:
        assert [id(m) for m in ours[name]] == [id(m) for m in theirs[name]], name


@pytest.mark.parametrize("inplace_kinds,predicate", [((), vissl_layer_splittable_before), (("seq", "other"), layer_splittable_before)])
def test_buckets_match_vissl_on_random_trunks(inplace_kinds, predicate):
    rng = random.Random(0)
    compared = 0
    for _ in range(600):
        blocks, keys = _random_trunk(rng, inplace_kinds)
        splits = rng.randint(1, 14)
        try:
            theirs = vissl_checkpoint_trunk(blocks, keys, splits, predicate)
        except AssertionError:
            continue  # vissl refuses this input
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = checkpoint_trunk(blocks, keys, splits)
        assert not _cuts_before_unsplittable(ours, layer_splittable_before)
        if _cuts_before_unsplittable(theirs, predicate):
            continue  # vissl's layer-relu-relu TODO: it cuts before an in-place op, trunksplit does not
        _same(ours, theirs)
        compared += 1
    assert compared > 400


@pytest.mark.parametrize("arch", ["resnet50", "regnet_y_400mf"])
@pytest.mark.parametrize("splits", [1, 2, 4, 6, 8, 16])
def test_buckets_match_vissl_on_torchvision(arch, splits):
    blocks = feature_blocks(getattr(torchvision.models, arch)())
    for keys in (["flatten"], ["res3", "res5"], ["conv1", "res4", "flatten"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = checkpoint_trunk(blocks, keys, splits)
        _same(ours, vissl_checkpoint_trunk(blocks, keys, splits, layer_splittable_before))


def test_never_splits_before_the_stem_relu():
    blocks = feature_blocks(torchvision.models.resnet18())
    relu = blocks["conv1_relu"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for splits in range(1, 20):
            assert all(seq[0] is not relu for seq in checkpoint_trunk(blocks, ["flatten"], splits).values())


def test_unknown_key_names_it_and_the_known_keys():
    blocks = feature_blocks(torchvision.models.resnet18())
    with pytest.raises(ValueError, match=r"res9.*known keys.*conv1"):
        checkpoint_trunk(blocks, ["res9"], 2)


@pytest.mark.parametrize("splits", [0, -1, 1.5])
def test_bad_split_count_is_refused(splits):
    blocks = feature_blocks(torchvision.models.resnet18())
    with pytest.raises(ValueError, match="splits"):
        checkpoint_trunk(blocks, ["flatten"], splits)


def test_unreachable_split_count_warns_with_count_reached():
    blocks = OrderedDict(a=nn.Conv2d(1, 1, 1), b=nn.ReLU(inplace=True), c=nn.Conv2d(1, 1, 1))
    with pytest.warns(UserWarning, match="only 2 can be made"):
        out = checkpoint_trunk(blocks, ["c"], 5)
    assert [len(s) for s in out.values()] == [2, 1]


@pytest.mark.parametrize("splits,headline", [(1, "vissl, 1 segment"), (3, "vissl, 3 segments")])
def test_a_plan_names_its_strategy_and_segment_count_in_english(splits, headline):
    """The launcher's last line and ``print(plan)`` read "1 segment", not "1 segments"."""
    plan = CheckpointedTrunk(torchvision.models.resnet18(), ["flatten"], num_splits=splits).plan
    assert plan.headline == headline and str(plan).startswith(f"SplitPlan ({headline}")


def test_plan_prints_a_table_of_segments():
    trunk = CheckpointedTrunk(torchvision.models.resnet18(), ["flatten"], num_splits=3)
    text = str(trunk.plan)
    lines = text.splitlines()
    assert lines[0].startswith("SplitPlan (vissl, 3 segments")
    assert "segment" in lines[1] and "layers" in lines[1] and "count" in lines[1]
    body = [line for line in lines[3:] if line.startswith("|")]  # the rows; notes follow the table
    assert len(body) == 3
    counts = [int(line.split("|")[3]) for line in body]
    assert sum(counts) == 4 + 8 + 2  # stem (4), 8 basic blocks, avgpool + flatten
    assert body[0].split("|")[2].strip().startswith("conv1 ..")
    assert body[-1].split("|")[2].strip().endswith(".. flatten")


def test_a_one_unit_segment_is_named_once():
    """A segment of one block reads ``res2.1``, not ``res2.1 .. res2.1`` (the quick start's plan had one)."""
    plan = CheckpointedTrunk(torchvision.models.resnet18(), ["flatten"], num_splits=13).plan  # vissl's finest: a block each
    layers = [line.split("|")[2].strip() for line in str(plan).splitlines()[3:] if line.startswith("|")]
    # by hand: every unit alone but the in-place ReLU, which stays with bn1 (vissl never splits before it)
    assert layers == ["conv1", "bn1 .. conv1_relu", "maxpool", "res2.0", "res2.1", "res3.0", "res3.1", "res4.0", "res4.1", "res5.0", "res5.1", "avgpool", "flatten"]


def test_where_vissl_would_assert_a_clear_error_is_raised():
    # vissl: "assert max(lengths) > 0, 'Something wrong, we shouldn't have an empty list'"
    blocks = OrderedDict(res2=nn.Sequential(), res3=nn.Sequential())
    with pytest.raises(ValueError, match="empty"):
        checkpoint_trunk(blocks, ["res2", "res3"], 4)


def test_a_vissl_plan_says_why_it_has_no_predicted_memory_and_the_command_it_names_measures_it(capsys):
    """vissl's plan measures nothing, so its table lacks the memory columns a balanced plan's has; a
    newcomer's first ``print(trunk.plan)`` said nothing of why. The command it names prints the same cuts
    with their predicted peaks."""
    import torch
    from trunksplit.cli.parser import main
    from trunksplit.planning.search import unsplit_plan

    x = torch.randn(2, 3, 64, 64)
    printed = str(CheckpointedTrunk(torchvision.models.resnet18(), ["res4", "flatten"], num_splits=4).plan_for(x))
    assert "predicted memory: not measured (vissl cuts by module count); trunksplit plan --features" in printed
    assert "predicted memory: not measured" not in str(CheckpointedTrunk(torchvision.models.resnet18(), ["res4", "flatten"], num_splits=4,
                                                                          strategy="balanced").plan_for(x))
    # a measured plan that runs unsplit has no per-segment columns either, and was measured
    assert "not measured" not in str(unsplit_plan(["conv1", "flatten"], {"flatten": 2}, "balanced", 2**20, "every cut is predicted above"))
    assert main(["plan", "--arch", "resnet18", "--features", "res4", "flatten", "--splits", "4", "--input", "2x3x64x64"]) == 0
    measured = capsys.readouterr().out
    cuts = lambda text: [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ") and "segment" not in line]  # noqa: E731
    assert cuts(measured) == cuts(printed) and len(cuts(printed)) == 4 and "predicted peak (MiB)" in measured
