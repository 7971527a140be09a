"""What travels between the run's processes: the training sample the rollout worker queues and the
trainer packs, and metrics with their window reduction declared where they are recorded."""
