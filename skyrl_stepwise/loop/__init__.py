"""The driver: the step loop (`loop.py`, read top to bottom), the SFT warm start, evaluation, tracking, rollouts
ahead of the update, and the guards that stop or repair a run (engine recovery, divergence, agreement)."""
