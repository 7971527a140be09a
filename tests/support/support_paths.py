"""Where the suite's folders are: for the tests that start a support script in a subprocess or read
the shipped data."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
DATA = TESTS / "data"
