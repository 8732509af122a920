"""Benchmarks behind `tandem bench`: programs, not timed tests. Each prints a
short table last and can write JSON; see BENCHMARKS.md for recorded runs."""
