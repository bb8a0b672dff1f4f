"""Decisions, in pure Python: blocks, block tables and the scheduler. No torch here."""
