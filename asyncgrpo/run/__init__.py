"""A run's own files and processes: the directory lock, the file names and durable writes, the
timeline and its CPU counters, helper processes that end with their parent, and keeping secrets out of
what a run prints and writes. Nothing here knows the trainer, the model or the servers."""
