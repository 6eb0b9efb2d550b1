#!/usr/bin/env python
"""lightly's SimCLR example under PyTorch Lightning, with a checkpointed trunk: runnable as it is.

    pip install -e ".[clients]"
    python docs/recipes/lightning_lightly_simclr.py --steps 20 --batch 32 --size 64

lightly's example (docs.lightly.ai, "SimCLR") with the two lines that change marked ``# changed``;
the images are torchvision's ``FakeData`` (generated, nothing downloaded). Give ``--data`` an
ImageFolder root to train on your own images. docs/integrations.md shows the two lines.
"""
import argparse

import pytorch_lightning as pl
import torch
import torchvision
from lightly.loss import NTXentLoss
from lightly.models.modules import SimCLRProjectionHead
from lightly.transforms.simclr_transform import SimCLRTransform

import trunksplit


class SimCLR(pl.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        resnet = torchvision.models.resnet18()
        self.backbone = trunksplit.CheckpointedTrunk(resnet, ["flatten"], num_splits=3, strategy="balanced")  # changed
        self.projection_head = SimCLRProjectionHead(512, 512, 128)
        self.criterion = NTXentLoss()
        self.lr = lr

    def forward(self, x):
        x = self.backbone(x)[0]  # changed: the trunk returns the features asked for, flattened
        return self.projection_head(x)

    def training_step(self, batch, batch_index):
        (x0, x1) = batch[0]
        loss = self.criterion(self.forward(x0), self.forward(x1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=64, help="crop size (lightly's transform)")
    p.add_argument("--data", default="", help="an ImageFolder root; default: torchvision's generated FakeData")
    p.add_argument("--lr", type=float, default=0.06)
    args = p.parse_args(argv)
    transform = SimCLRTransform(input_size=args.size)
    if args.data:
        dataset = torchvision.datasets.ImageFolder(args.data, transform=transform)
    else:
        dataset = torchvision.datasets.FakeData(size=args.batch * args.steps, image_size=(3, args.size, args.size), transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = SimCLR(args.lr)
    trainer.fit(model, loader)
    print(f"trained {trainer.global_step} steps; last loss {float(trainer.callback_metrics['train_loss']):.4f}; "
          f"trunk plan: {model.backbone.plan.strategy}, {len(model.backbone.plan.segments)} segments")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
