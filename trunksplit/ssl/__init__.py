"""What ``tools/train.py`` needs to train a self-supervised model on a checkpointed trunk."""
