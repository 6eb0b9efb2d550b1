"""A faithful re-statement of vissl's ``checkpoint_trunk`` (shared/seeds/002), the
reference trunksplit's bucketing is checked against. Only change: the
``layer_splittable_before`` predicate is a parameter, so the same algorithm can
run with vissl's string test or with trunksplit's broader one.
"""
from torch import nn


def vissl_layer_splittable_before(m):
    return str(m) != "ReLU(inplace=True)"


def vissl_checkpoint_trunk(feature_blocks, unique_out_feat_keys, checkpointing_splits, layer_splittable_before=vissl_layer_splittable_before):
    feature_blocks_bucketed = []
    bucket = []
    for feature_name, feature_block in feature_blocks.items():
        if feature_name.startswith("res"):
            for b in feature_block:
                bucket.append(b)
        else:
            bucket.append(feature_block)
        if feature_name in unique_out_feat_keys:
            feature_blocks_bucketed.append([feature_name, bucket])
            bucket = []
    split_times = 0
    while len(feature_blocks_bucketed) < checkpointing_splits:
        lengths = [len(v) for _, v in feature_blocks_bucketed]
        assert max(lengths) > 0, "Something wrong, we shouldn't have an empty list"
        if max(lengths) == 1:
            break
        if max(lengths) == 2:
            found = False
            for i, (_, v) in enumerate(feature_blocks_bucketed):
                if len(v) == 2 and layer_splittable_before(v[1]):
                    found = True
                    i_max = i
                    break
            if not found:
                break
        else:
            i_max = lengths.index(max(lengths))
        n_split_layers = len(feature_blocks_bucketed[i_max][1]) // 2
        biggest_block = feature_blocks_bucketed[i_max]
        if not layer_splittable_before(biggest_block[1][n_split_layers]):
            assert len(biggest_block[1]) > 2
            if n_split_layers == len(biggest_block[1]) - 1:
                n_split_layers -= 1
            else:
                n_split_layers += 1
        assert n_split_layers > 0 and n_split_layers < len(biggest_block[1]), "Should never split into an empty list and the rest"
        feature_blocks_bucketed = (
            feature_blocks_bucketed[:i_max]
            + [[f"activation_split_{split_times}", biggest_block[1][:n_split_layers]]]
            + [[biggest_block[0], biggest_block[1][n_split_layers:]]]
            + feature_blocks_bucketed[(i_max + 1) :]
        )
        split_times += 1
    feature_blocks = {block[0]: nn.Sequential(*block[1]) for block in feature_blocks_bucketed}
    assert len(feature_blocks) == len(feature_blocks_bucketed)
    return feature_blocks
