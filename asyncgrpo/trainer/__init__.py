"""The training side: AsyncGRPOTrainer and what its loop uses (sample intake, resume ledger, progress)."""
