"""SwAV's queue and frozen prototypes: against SwAV's own loop (main_swav.py, written out here), one
process against two ranks, DDP against FSDP2, resumed, and refused where set wrong."""
import contextlib
import copy
import os
import types

import pytest
import torch
import torch.nn.functional as F

from distributed_harness import run_processes
from trunksplit.ssl.config import load_config
from trunksplit.ssl.model import build_ssl_model
from trunksplit.ssl.grouped import grouped_step
from trunksplit.ssl.loop import train, whole_step_loss
from trunksplit.ssl.optim import gradient_rule
from trunksplit.ssl.swav import check_queue_shares, fill_queue, swav_codes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SWAV = ["METHOD.NAME", "swav", "METHOD.NUM_PROTOTYPES", "10", "MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "MODEL.HEAD.HIDDEN_DIM", "32", "MODEL.HEAD.OUTPUT_DIM", "8",
        "DATA.IMAGE_SIZE", "40", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 2]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]",
        "TRAIN.BATCH_SIZE_PER_RANK", "4", "DATA.NUM_WORKERS", "0", "OPTIM.LR", "0.05", "MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "vissl"]
DIM, PROTOTYPES, LARGE = 8, 10, 2


def _swavs_sinkhorn(out, iterations=3, epsilon=0.05):
    """main_swav.py's ``distributed_sinkhorn`` on one process, in float64."""
    q = torch.exp(out.double() / epsilon).t()
    b, k = q.shape[1], q.shape[0]
    q /= q.sum()
    for _ in range(iterations):
        q /= q.sum(dim=1, keepdim=True)
        q /= k
        q /= q.sum(dim=0, keepdim=True)
        q /= b
    return (q * b).t()


def _step_inputs(steps, batch, seed=0):
    """Each step's unit embeddings of the two large crops and the prototypes' scores of them."""
    g = torch.Generator().manual_seed(seed)
    prototypes = F.normalize(torch.randn(PROTOTYPES, DIM, generator=g), dim=1)
    embeddings = [[F.normalize(torch.randn(batch, DIM, generator=g), dim=1) for _ in range(LARGE)] for _ in range(steps)]
    return prototypes, embeddings


def _model(prototypes, length):
    """What ``swav_codes`` reads of a model: its prototypes, its queue and how many of its rows are filled (none)."""
    layer = torch.nn.Linear(DIM, PROTOTYPES, bias=False)
    layer.weight.data.copy_(prototypes)
    return types.SimpleNamespace(prototypes=layer, queue=torch.zeros(LARGE, length, DIM) if length else None, queue_rows=0)


def _queued(length, start):
    return load_config(QUICK, [*SWAV, "METHOD.SWAV.QUEUE_LENGTH", str(length), "METHOD.SWAV.QUEUE_START_STEP", str(start)])


def test_the_queue_fills_and_is_used_as_in_swavs_own_loop():
    """main_swav.py, step by step: from epoch_queue_starts (here step 1) each large crop's embeddings go in
    front of its queue; once the last row is filled, the queue's scores against the current prototypes
    lead the batch's into Sinkhorn, whose last ``batch`` rows are the codes. Batch 4, queue 12: used from
    step 4 on; the codes differ from the batch's own there."""
    batch, length, start, steps = 4, 12, 1, 6
    prototypes, embeddings = _step_inputs(steps, batch)
    cfg, model = _queued(length, start), _model(prototypes, length)
    reference_queue, used = torch.zeros(LARGE, length, DIM, dtype=torch.float64), []
    for step in range(steps):
        scores = [e @ prototypes.t() for e in embeddings[step]]
        codes = swav_codes(cfg, model, scores, embeddings[step], step)
        for i in range(LARGE):  # main_swav.py's loop over crops_for_assign
            out = scores[i].double()
            if step >= start:  # the queue exists from epoch_queue_starts on
                if not torch.all(reference_queue[i, -1] == 0):
                    out = torch.cat([reference_queue[i] @ prototypes.double().t(), out])
                    used.append(step)
                reference_queue[i, batch:] = reference_queue[i, :-batch].clone()
                reference_queue[i, :batch] = embeddings[step][i]
            expected = _swavs_sinkhorn(out)[-batch:]
            torch.testing.assert_close(codes[i].double(), expected, rtol=1e-4, atol=1e-6)
            if step in used:
                assert not torch.allclose(expected, _swavs_sinkhorn(scores[i]), atol=1e-3)  # the queue changed the codes
        torch.testing.assert_close(model.queue.double(), reference_queue, rtol=0, atol=1e-7)
    assert sorted(set(used)) == [4, 5]


def _two_ranks(rank, world_size, prototypes, embeddings, expected_codes, expected_queue):
    cfg, model = _queued(16, 0), _model(prototypes, 16)
    for step, (step_embeddings, codes) in enumerate(zip(embeddings, expected_codes)):
        mine = [e[4 * rank: 4 * rank + 4] for e in step_embeddings]
        got = swav_codes(cfg, model, [e @ prototypes.t() for e in mine], mine, step)
        for i in range(LARGE):
            torch.testing.assert_close(got[i], codes[i][4 * rank: 4 * rank + 4], rtol=1e-5, atol=1e-7, msg=f"step {step}")
    assert torch.equal(model.queue, expected_queue)  # every rank holds the whole queue, the same


def test_two_ranks_share_one_queue_and_get_the_codes_of_one_process_with_the_whole_batch():
    """2 gloo ranks of 4 images, a queue of 16 (each rank scores its 8 rows) against one process of the
    8 images and the same queue: the same codes, each rank its rows, at every step (used from step 2)."""
    prototypes, embeddings = _step_inputs(4, 8)
    cfg, model = _queued(16, 0), _model(prototypes, 16)
    expected = [swav_codes(cfg, model, [e @ prototypes.t() for e in mine], mine, step) for step, mine in enumerate(embeddings)]
    run_processes(_two_ranks, 2, (prototypes, embeddings, expected, model.queue), timeout=120)


def test_a_queue_needs_the_steps_embeddings_and_ranks_that_can_share_it():
    cfg = _queued(12, 0)
    model = _model(torch.eye(PROTOTYPES, DIM), 12)
    with pytest.raises(ValueError, match="embeddings=True"):
        swav_codes(cfg, model, [torch.zeros(4, PROTOTYPES)] * 2, None, 0)
    assert torch.equal(model.queue, torch.zeros(LARGE, 12, DIM))
    check_queue_shares(cfg, 4)  # 3 rows a rank
    with pytest.raises(ValueError, match="METHOD.SWAV.QUEUE_LENGTH 12 cannot be shared by this run's 5 ranks .* multiple of 5, such as 10"):
        check_queue_shares(cfg, 5)


@pytest.mark.parametrize("key", ["QUEUE_LENGTH", "QUEUE_START_STEP", "FREEZE_PROTOTYPES_STEPS"])
def test_negative_swav_counts_are_refused(key):
    with pytest.raises(ValueError, match=f"METHOD.SWAV: {key} -1: each is a count"):
        load_config(QUICK, [*SWAV, f"METHOD.SWAV.{key}", "-1"])


def test_the_prototypes_stay_frozen_for_their_steps_while_the_rest_trains(tmp_path):
    """Two steps with the prototypes frozen: they are the initial ones made unit rows (as every step
    begins), with no optimizer state; the head moved. From step 2 the rule lets them train."""
    cfg = load_config(QUICK, [*SWAV, "OUTPUT_DIR", str(tmp_path), "TRAIN.STEPS", "2", "METHOD.SWAV.FREEZE_PROTOTYPES_STEPS", "2"])
    torch.manual_seed(0)
    initial = build_ssl_model(cfg)
    model, _ = train(cfg)
    assert torch.allclose(model.prototypes.weight, F.normalize(initial.prototypes.weight, dim=1), rtol=0, atol=1e-7)
    assert not torch.equal(model.head[0].weight, initial.head[0].weight)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["optimizer"]
    index = [n for n, p in model.named_parameters() if p.requires_grad].index("prototypes.weight")
    assert index not in saved["state"] and len(saved["state"]) > 0
    p = model.prototypes.weight
    p.grad = torch.ones_like(p)
    assert gradient_rule(cfg, model, step=2) is None  # nothing left to run: the optimizer updates them
    assert not gradient_rule(cfg, model, step=1)(p) and p.grad is None


def test_a_step_with_the_queue_in_use_gives_the_grouped_and_the_whole_step_alike():
    """The queue full: the whole step (one backward) and the grouped one give the same loss and gradients,
    and push the same embeddings."""
    cfg = _queued(8, 0)
    torch.manual_seed(0)
    model = fill_queue(build_ssl_model(cfg))
    g = torch.Generator().manual_seed(1)
    crops = [torch.randn(4, 3, s, s, generator=g) for s in (32, 32, 16, 16)]
    whole, grouped = copy.deepcopy(model), copy.deepcopy(model)
    outputs, embeddings = whole(crops, embeddings=True)
    loss = whole_step_loss(cfg, whole, outputs, crops, 0, embeddings)
    loss.backward()
    queueless = copy.deepcopy(model)
    queueless.queue = None
    without_queue = whole_step_loss(cfg, queueless, outputs, crops, 0, embeddings)
    got = grouped_step(cfg, grouped, grouped, crops, 0, contextlib.nullcontext(), lambda part: part.backward(), contextlib.nullcontext)
    assert abs(got.item() / loss.item() - 1) <= 1e-6
    for (name, a), b in zip(whole.named_parameters(), grouped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8, msg=name)
    assert torch.equal(whole.queue, grouped.queue) and not torch.equal(whole.queue, model.queue)
    torch.testing.assert_close(whole.queue[:, :4], torch.stack(embeddings[:2]))  # the large crops' embeddings lead it
    assert without_queue.item() != loss.item()  # the queue's scores changed the codes


def _ddp_then_fsdp(rank, world_size, out):
    """Three SwAV steps under DDP, then FSDP2, in the same two processes: a queue of 16 (8 embeddings a
    step: used at step 3), prototypes frozen in step 1; each run's full weights and queue."""
    from torch.distributed.tensor import DTensor

    for strategy in ("ddp", "fsdp"):
        model, _ = train(load_config(QUICK, ["OUTPUT_DIR", os.path.join(out, strategy), *SWAV, "TRAIN.STEPS", "3", "DISTRIBUTED.STRATEGY", strategy,
                                             "METHOD.SWAV.QUEUE_LENGTH", "16", "METHOD.SWAV.FREEZE_PROTOTYPES_STEPS", "1",
                                             "OPTIM.CLIP_GRAD", "1e-4"]))  # every gradient clipped: Sinkhorn's exp(score / 0.05) magnifies
        # the rounding of FSDP2's reduction in each crop group (DDP's: once) into the codes, and the next step's gradients
        state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
        state["queue"] = model.queue.clone()
        torch.save(state, os.path.join(out, f"{strategy}{rank}.pt"))


def test_under_fsdp2_the_queue_is_scored_by_the_whole_prototypes_and_trains_the_ddp_runs_weights(tmp_path):
    """FSDP2 holds a shard of the prototypes outside forward; the queue is scored by the whole of them. Both
    strategies end with the same weights and the same queue on every rank, to float rounding."""
    run_processes(_ddp_then_fsdp, 2, (str(tmp_path),))
    ddp = [torch.load(tmp_path / f"ddp{rank}.pt") for rank in range(2)]
    assert torch.equal(ddp[0]["queue"], ddp[1]["queue"]) and bool(ddp[0]["queue"][:, -1].any())
    for rank in range(2):
        fsdp = torch.load(tmp_path / f"fsdp{rank}.pt")
        for name, value in fsdp.items():
            torch.testing.assert_close(value, ddp[0][name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
