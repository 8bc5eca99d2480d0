"""The model and its blocks, one stage's compute and optimizer, data, schedules, checkpoints, HF blocks."""
