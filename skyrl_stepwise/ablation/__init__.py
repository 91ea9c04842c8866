"""Step-wise vs merged vs whole-trajectory: the same rollouts, each mode's samples, their cost."""
