"""The RL algorithm, free of Ray and FSDP: group advantages, step-level credit and the PPO/TIS loss."""
