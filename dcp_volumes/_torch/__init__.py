"""What dcp_volumes takes from torch beyond its stable public API, in one place.

Version guards (features newer than the oldest torch we support, 2.6) and the
few private names we need live in this package, each behind one named alias or
function, so a torch release that moves one is mended here alone:
``checkpoint`` for DCP and the stager, ``data`` for the DataLoader's side (its
workers import it, and must not pay for importing DCP).
``tests/test_no_private_internals.py`` allows private torch names only here.
"""
