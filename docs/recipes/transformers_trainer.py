#!/usr/bin/env python
"""A Hugging Face vision transformer under ``Trainer`` at a memory budget, in place of
``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` in older transformers): runnable as it is.

    pip install -e ".[clients]"
    python docs/recipes/transformers_trainer.py --budget 0.8 --batch 8 --steps 5

One changed line (marked ``# changed``); the Trainer is unchanged. A small ``ViTConfig`` (64px,
4 layers) with random weights and generated, labelled images: nothing is downloaded. It prints
the plan (the blocks it wrapped, its peak against the unwrapped step's) and the last loss.
"""
import argparse

import torch
import transformers

import trunksplit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=0.8, help="a fraction of the unwrapped step's peak")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="output/transformers_trainer", help="the Trainer's output_dir")
    args = p.parse_args(argv)
    config = transformers.ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                    intermediate_size=128, num_labels=3)
    g = torch.Generator().manual_seed(0)
    data = [{"pixel_values": torch.randn(3, 64, 64, generator=g), "labels": i % 3} for i in range(args.batch * args.steps)]
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config)
    example = torch.stack([d["pixel_values"] for d in data[:args.batch]])
    plan = trunksplit.apply_activation_checkpointing(model, memory_budget=args.budget, example_inputs=(example,))  # changed: was model.activation_checkpointing_enable()
    print(plan)
    training = transformers.TrainingArguments(args.out, per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=1e-3,
                                              report_to=[], save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=data)
    result = trainer.train()
    print(f"trained {result.global_step} steps; last loss {trainer.state.log_history[-2]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
