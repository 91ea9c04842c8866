"""What runs on a policy rank: the FSDP2 worker and its group, batching and packing (with the per-architecture
self-check), the prefix tree, LoRA, dropout control, and the weight sync to the engines. Its typed config is
`policy.config` (the `trainer.*` keys)."""
