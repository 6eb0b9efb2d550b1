#!/usr/bin/env python
"""lightly's DINO example in a loop of your own, backward by crop group, on a checkpointed trunk:
runnable as it is.

    pip install -e ".[clients]"
    python docs/recipes/lightly_dino_by_crop_group.py --steps 5 --batch 8 --global-size 224 --local-size 96

lightly's example (docs.lightly.ai, "DINO": resnet18, ``DINOProjectionHead``, ``DINOLoss``,
``DINOTransform``) with its backbone a ``CheckpointedTrunk`` and its step run one crop resolution at
a time: the teacher's targets first, then each resolution's forward, its share of the loss and its
backward before the next one's, so one group's activations are alive at a time. ``DINOLoss`` keeps
its centre and temperatures; its centre moves once a step. The first step also runs lightly's whole
step (``criterion(teacher_out, student_out)``, one backward) on a model built alike, and prints both peaks (tensor
bytes on a CPU, the allocator on CUDA). Images: torchvision's generated ``FakeData``, or ``--data``
an ImageFolder root. docs/integrations.md shows the grouped step. At 8 images of 224px + 96px it
peaked at 0.85 of the whole step on a CPU (2026-11-26); at a few small crops the gradients, alive
from the first group's backward on, outweigh the activations it saves.
"""
import argparse
import copy

import torch
import torch.nn.functional as F
import torchvision
from lightly.loss import DINOLoss
from lightly.models.modules import DINOProjectionHead
from lightly.models.utils import deactivate_requires_grad, update_momentum
from lightly.transforms.dino_transform import DINOTransform

import trunksplit


class DINO(torch.nn.Module):
    def __init__(self, output_dim: int):
        super().__init__()
        resnet = torchvision.models.resnet18()
        self.student_backbone = trunksplit.CheckpointedTrunk(resnet, ["flatten"], num_splits=3, strategy="balanced")  # changed
        self.student_head = DINOProjectionHead(512, 512, 64, output_dim, freeze_last_layer=1)
        self.teacher_backbone = copy.deepcopy(self.student_backbone)
        self.teacher_head = DINOProjectionHead(512, 512, 64, output_dim)
        deactivate_requires_grad(self.teacher_backbone)
        deactivate_requires_grad(self.teacher_head)

    def forward(self, x):
        return self.student_head(self.student_backbone(x)[0])  # changed: the trunk returns the features asked for

    def forward_teacher(self, x):
        return self.teacher_head(self.teacher_backbone(x)[0])


def backward_by_crop_group(model, crops, center, student_temp, teacher_temp, n_global=2):
    """DINO's loss over every (global crop, other crop) pair, backward one resolution at a time;
    returns the loss (detached) and the teacher's outputs, for the centre."""
    with torch.no_grad():
        teacher_out = model.forward_teacher(torch.cat(crops[:n_global])).chunk(n_global)
        targets = [F.softmax((t - center) / teacher_temp, dim=-1) for t in teacher_out]
    pairs = n_global * (len(crops) - 1)
    total, start = 0.0, 0
    while start < len(crops):
        stop = start
        while stop < len(crops) and crops[stop].shape == crops[start].shape:
            stop += 1
        outputs = model(torch.cat(crops[start:stop])).chunk(stop - start)
        part = sum(-(q * F.log_softmax(s / student_temp, dim=-1)).sum(-1).mean()
                   for i, q in enumerate(targets) for j, s in enumerate(outputs, start) if j != i) / pairs
        part.backward()
        total += part.detach()
        start = stop
    return total, teacher_out


def grouped_backward(model, criterion, crops, epoch):
    """The step's forward and backward, by crop group, at DINOLoss's centre and temperatures."""
    schedule = criterion.teacher_temp_schedule
    teacher_temp = schedule[min(epoch, len(schedule) - 1)].item()
    return backward_by_crop_group(model, crops, criterion.center[0], criterion.student_temp, teacher_temp)


def finish_step(model, criterion, teacher_out, optimizer, epoch):
    criterion.update_center(torch.stack(teacher_out))  # what DINOLoss's forward does, once a step
    model.student_head.cancel_last_layer_gradients(epoch)
    optimizer.step()
    optimizer.zero_grad()


def whole_step(model, criterion, crops, epoch):
    """lightly's step as its example writes it: every crop's forward, one loss, one backward."""
    teacher_out = [model.forward_teacher(view) for view in crops[:2]]
    student_out = [model.forward(view) for view in crops]
    criterion(teacher_out, student_out, epoch=epoch).backward()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--global-size", type=int, default=224)
    p.add_argument("--local-size", type=int, default=96)
    p.add_argument("--output-dim", type=int, default=2048, help="the head's outputs (lightly's example: 65536)")
    p.add_argument("--data", default="", help="an ImageFolder root; default: torchvision's generated FakeData")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    transform = DINOTransform(global_crop_size=args.global_size, local_crop_size=args.local_size)
    if args.data:
        dataset = torchvision.datasets.ImageFolder(args.data, transform=transform)
    else:
        dataset = torchvision.datasets.FakeData(size=args.batch * args.steps, image_size=(3, args.global_size, args.global_size), transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True)
    torch.manual_seed(0)
    model = DINO(args.output_dim).to(device)
    criterion = DINOLoss(output_dim=args.output_dim, warmup_teacher_temp_epochs=5).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, (crops, _) in enumerate(loader):
        crops = [c.to(device) for c in crops]
        update_momentum(model.student_backbone, model.teacher_backbone, m=0.99)
        update_momentum(model.student_head, model.teacher_head, m=0.99)
        if step == 0:  # both steps once, side by side, on models built alike (weight_norm's heads cannot be deep-copied)
            torch.manual_seed(0)
            whole = DINO(args.output_dim).to(device)
            whole_step(whole, copy.deepcopy(criterion), crops, epoch=0)  # plans each resolution, warms up
            whole.zero_grad(set_to_none=True)
            with trunksplit.PeakMemory(device) as whole_peak:
                whole_step(whole, copy.deepcopy(criterion), crops, epoch=0)
            with trunksplit.PeakMemory(device) as grouped_peak:
                loss, teacher_out = grouped_backward(model, criterion, crops, epoch=0)
            print(f"step peak: lightly's whole step {whole_peak.peak_bytes / 2**20:.1f} MiB, by crop group {grouped_peak.peak_bytes / 2**20:.1f} MiB "
                  f"({grouped_peak.peak_bytes / whole_peak.peak_bytes:.2f} of it)")
        else:
            loss, teacher_out = grouped_backward(model, criterion, crops, epoch=0)
        finish_step(model, criterion, teacher_out, optimizer, epoch=0)
    print(f"trained {step + 1} steps; last loss {float(loss):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
