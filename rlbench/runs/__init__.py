"""What a run leaves on disk: run names and the run-folder lock (`folders.py`), checkpoint folders written atomically
and found again (`checkpoints.py`), metrics rows to JSONL, TensorBoard or wandb (`sinks.py`), and progress bars
(`progress.py`). Ground floor: nothing here imports the rest of rlbench."""
