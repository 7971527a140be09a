"""The rollout side: the loop that generates and scores in a spawned process, and its plumbing."""
