"""Experiments over many sessions: recipes and leaderboards read from TOML (`recipes.py`), sweeps of settings x seeds
run as Ray tasks and resumed (`sweeps.py`, `rl.sweep`), and bootstrap intervals over their runs (`stats.py`)."""
