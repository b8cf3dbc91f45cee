"""Tests of ``transformers serve`` under ``tokentrace run`` (the real server, the tiny model)."""
