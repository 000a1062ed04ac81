"""Helpers run in child processes by the checkpoint-manager tests (crash injection, ranks)."""
