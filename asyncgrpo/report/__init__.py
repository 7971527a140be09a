"""Reading a finished (or running) run: its metrics history, plots, diagnosis and HTML report."""
